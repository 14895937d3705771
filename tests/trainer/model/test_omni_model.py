"""omni.py: shapes, loss semantics, document isolation, temporal rotary positions, learning, layering."""

from __future__ import annotations

import ast
import pathlib

import pytest
import torch
import torch.nn.functional as F

import resilient.trainer.model as model_package
from resilient.trainer.model import Modality, ModelConfig, OmniModel, synthetic_batch

PAD, T, A, V = 0, 1, 2, 3
CONFIG = ModelConfig(
    dim=32,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    ffn_hidden_dim=64,
    vocab_size=64,
    audio_dim=6,
    video_dim=10,
    max_positions=64,
)


def _batch(modality: list[int], doc_ids: list[int], positions: list[int], seed: int = 0) -> dict:
    """One row built by hand, with random content at each position's modality."""
    generator = torch.Generator().manual_seed(seed)
    modality_t = torch.tensor([modality])
    length = len(modality)
    return {
        "text_tokens": torch.randint(1, CONFIG.vocab_size, (1, length), generator=generator) * (modality_t == T),
        "audio_frames": torch.randn(1, length, CONFIG.audio_dim, generator=generator) * (modality_t == A).unsqueeze(-1),
        "video_patches": torch.randn(1, length, CONFIG.video_dim, generator=generator)
        * (modality_t == V).unsqueeze(-1),
        "modality": modality_t,
        "positions": torch.tensor([positions]),
        "doc_ids": torch.tensor([doc_ids]),
    }


DOC = [T, T, A, A, A, T, V, V, V, T]  # one document: text, audio frames, text, video patches, text
DOC_POSITIONS = [0, 1, 2, 3, 4, 5, 6, 6, 7, 8]  # two patches of one frame share a temporal position


@pytest.fixture(scope="module")
def model() -> OmniModel:
    return OmniModel(CONFIG, seed=3).eval()


@pytest.mark.timeout(60)
def test_shapes_and_finite_loss(model: OmniModel) -> None:
    batch = synthetic_batch(CONFIG, batch_size=3, seq_len=40, seed=1)
    assert model.features(batch).shape == (3, 40, CONFIG.dim)
    out = model(batch)
    assert out.loss.shape == () and torch.isfinite(out.loss)
    assert out.num_loss_tokens.dtype == torch.int64
    assert int(out.num_loss_tokens) == int(out.num_text_tokens) + int(out.num_media_tokens) > 0
    # Untrained: text cross-entropy near ln(vocab), the summed loss is the weighted sum.
    assert abs(float(out.text_loss) - torch.log(torch.tensor(64.0)).item()) < 0.5
    expected = (out.text_loss_sum + CONFIG.media_loss_weight * out.media_loss_sum) / out.num_loss_tokens
    torch.testing.assert_close(out.loss.detach(), expected)
    # Extra keys are ignored.
    torch.testing.assert_close(model({**batch, "sample_ids": [[1, 2], [3], [4]]}).loss, out.loss)


@pytest.mark.timeout(60)
def test_loss_on_a_hand_built_row_matches_a_direct_computation(model: OmniModel) -> None:
    batch = _batch(DOC + [PAD, PAD], [0] * 10 + [-1, -1], DOC_POSITIONS + [0, 0])
    out = model(batch)
    # Targets: text after 0,4,8 (->1,5,9); audio 2->3, 3->4; video 6->7, 7->8.
    assert (int(out.num_text_tokens), int(out.num_media_tokens), int(out.num_loss_tokens)) == (3, 4, 7)
    hidden = model.features(batch)[0]
    text_in, text_out = [0, 4, 8], [1, 5, 9]
    text_sum = F.cross_entropy(model.text_head(hidden[text_in]), batch["text_tokens"][0, text_out], reduction="sum")
    audio_mse = (model.audio_head(hidden[[2, 3]]) - batch["audio_frames"][0, [3, 4]]).pow(2).mean(-1)
    video_mse = (model.video_head(hidden[[6, 7]]) - batch["video_patches"][0, [7, 8]]).pow(2).mean(-1)
    media_sum = audio_mse.sum() + video_mse.sum()
    torch.testing.assert_close(out.text_loss_sum, text_sum.detach())
    torch.testing.assert_close(out.media_loss_sum, media_sum.detach())
    torch.testing.assert_close(out.loss, (text_sum + 0.1 * media_sum) / 7)
    # A caller-supplied normalizer (e.g. the global token count) only rescales the same sum.
    torch.testing.assert_close(model(batch, loss_normalizer=70).loss, out.loss / 10)
    torch.testing.assert_close(model(batch, loss_normalizer=torch.tensor(70)).loss, out.loss / 10)


@pytest.mark.timeout(60)
def test_documents_in_a_row_do_not_see_each_other(model: OmniModel) -> None:
    other = [A, A, T, T, V, V]
    row = DOC + other + [PAD]
    doc_ids = [0] * 10 + [1] * 6 + [-1]
    positions = DOC_POSITIONS + [0, 1, 2, 3, 4, 4] + [0]
    base = model.features(_batch(row, doc_ids, positions, seed=0))[0]
    # Same layout, different content everywhere (seed): compare document by document.
    first_changed = _batch(row, doc_ids, positions, seed=1)
    second = _batch(row, doc_ids, positions, seed=0)
    for key in ("text_tokens", "audio_frames", "video_patches"):
        first_changed[key][0, 10:] = second[key][0, 10:]  # keep document 1, change document 0
    changed = model.features(first_changed)[0]
    torch.testing.assert_close(changed[10:16], base[10:16], atol=1e-6, rtol=0)
    assert not torch.allclose(changed[:10], base[:10])
    # And a whole packed row gives document 1 exactly what it gets alone at the start of a row.
    alone = model.features(_batch(other, [0] * 6, positions[10:16]))[0]
    packed = _batch(row, doc_ids, positions, seed=0)
    for key in ("text_tokens", "audio_frames", "video_patches"):
        packed[key][0, 10:16] = _batch(other, [0] * 6, positions[10:16])[key][0]
    torch.testing.assert_close(model.features(packed)[0, 10:16], alone, atol=1e-5, rtol=0)


@pytest.mark.timeout(60)
def test_padding_produces_no_nan_and_no_influence(model: OmniModel) -> None:
    batch = synthetic_batch(CONFIG, batch_size=2, seq_len=24, seed=2)
    for key in batch:
        batch[key][1] = -1 if key == "doc_ids" else 0  # an all-padding row
    training_model = OmniModel(CONFIG, seed=3)
    out = training_model(batch)
    out.loss.backward()
    assert torch.isfinite(out.loss)
    assert all(torch.isfinite(p.grad).all() for p in training_model.parameters())
    alone = model({key: value[:1] for key, value in batch.items()})
    torch.testing.assert_close(model(batch).loss, alone.loss)
    assert int(model(batch).num_loss_tokens) == int(alone.num_loss_tokens)
    # Nothing to learn anywhere (normalizer 0): the loss is 0, not 0/0.
    padding_only = {key: value[1:] for key, value in batch.items()}
    assert float(model(padding_only).loss.detach()) == 0.0
    assert float(model(padding_only, loss_normalizer=0).loss.detach()) == 0.0


@pytest.mark.timeout(60)
def test_rotary_embedding_follows_temporal_positions(model: OmniModel) -> None:
    batch = _batch(DOC, [0] * 10, DOC_POSITIONS)
    base = model.features(batch)
    # RoPE depends on position differences only: shifting the whole document changes nothing...
    shifted = {**batch, "positions": batch["positions"] + 17}
    torch.testing.assert_close(model.features(shifted), base, atol=1e-5, rtol=0)
    # ...but the positions in the batch are what it uses (not the index in the row): changing the
    # temporal spacing changes the outputs, and tokens with one shared position differ from the
    # row-index layout.
    by_index = {**batch, "positions": torch.arange(10).unsqueeze(0)}
    assert not torch.allclose(model.features(by_index), base, atol=1e-4)
    assert torch.allclose(model.features(by_index)[0, :7], base[0, :7], atol=1e-5)


@pytest.mark.timeout(120)
def test_loss_falls_when_overfitting_one_batch() -> None:
    torch.manual_seed(0)
    model = OmniModel(CONFIG, seed=0)
    batch = synthetic_batch(CONFIG, batch_size=2, seq_len=32, seed=4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(30):
        out = model(batch)
        out.loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(out.loss.detach()))
    assert losses[-1] < 0.3 * losses[0], losses


@pytest.mark.timeout(60)
def test_init_is_deterministic_in_the_seed_alone() -> None:
    torch.manual_seed(123)
    first = OmniModel(CONFIG, seed=5).state_dict()
    torch.manual_seed(456)
    second = OmniModel(CONFIG, seed=5).state_dict()
    assert all(torch.equal(first[key], second[key]) for key in first)
    other = OmniModel(CONFIG, seed=6).state_dict()
    assert not torch.equal(first["layers.0.attention.wq.weight"], other["layers.0.attention.wq.weight"])
    assert "rope_cos" not in first  # derived tables are not checkpointed


@pytest.mark.timeout(60)
def test_bfloat16_parameters() -> None:
    config = ModelConfig(
        dim=32, n_layers=1, n_heads=4, vocab_size=64, audio_dim=6, video_dim=10, max_positions=64, dtype="bfloat16"
    )
    model = OmniModel(config)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    out = model(synthetic_batch(config, batch_size=2, seq_len=16, seed=0))
    assert out.loss.dtype == torch.float32 and torch.isfinite(out.loss)


@pytest.mark.timeout(30)
def test_model_package_imports_nothing_from_torch_distributed() -> None:
    """Layering (DESIGN §2): model code knows no parallelism."""
    sources = sorted(pathlib.Path(model_package.__file__).parent.glob("*.py"))
    assert len(sources) >= 5
    for source in sources:
        tree = ast.parse(source.read_text(), filename=str(source))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""] + [f"{node.module}.{alias.name}" for alias in node.names]
            else:
                continue
            for name in names:
                assert not name.startswith("torch.distributed"), f"{source.name} imports {name}"
                assert "parallelize" not in name, f"{source.name} imports {name}"


@pytest.mark.timeout(30)
def test_modality_values_match_the_contract() -> None:
    assert [int(m) for m in Modality] == [PAD, T, A, V]
