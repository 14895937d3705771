"""masking.py: document-causal attention mask and loss target masks on hand-built rows."""

from __future__ import annotations

import pytest
import torch

from resilient.trainer.model import count_loss_tokens, document_causal_mask, loss_targets

PAD, T, A, V = 0, 1, 2, 3


@pytest.mark.timeout(30)
def test_mask_is_causal_within_documents_and_padding_sees_only_itself() -> None:
    doc_ids = torch.tensor([[0, 0, 1, 1, -1]])
    mask = document_causal_mask(doc_ids)[0, 0].int()
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0],
            [1, 1, 0, 0, 0],
            [0, 0, 1, 0, 0],
            [0, 0, 1, 1, 0],
            [0, 0, 0, 0, 1],
        ]
    )
    assert torch.equal(mask, expected)


@pytest.mark.timeout(30)
def test_loss_targets_on_a_hand_built_row() -> None:
    # position:   0  1  2  3  4  5  6  7
    modality = torch.tensor([[T, T, A, A, T, V, V, PAD], [T, T, T, T, PAD, PAD, PAD, PAD]])
    doc_ids = torch.tensor([[0, 0, 0, 0, 0, 1, 1, -1], [0, 0, 1, 1, -1, -1, -1, -1]])
    targets = loss_targets(modality, doc_ids)
    # Row 0: 0->1 text; 2->3 audio; 3->4 text (media input, text target); 4->5 crosses documents;
    # 5->6 video; 6->7 is padding. Row 1: 0->1 and 2->3 text, 1->2 crosses documents.
    assert targets.text.nonzero().tolist() == [[0, 0], [0, 3], [1, 0], [1, 2]]
    assert targets.audio.nonzero().tolist() == [[0, 2]]
    assert targets.video.nonzero().tolist() == [[0, 5]]
    assert int(count_loss_tokens({"modality": modality, "doc_ids": doc_ids})) == 6
    # A modality change inside a document is not a frame target: audio followed by video is neither.
    mixed = loss_targets(torch.tensor([[A, V]]), torch.tensor([[0, 0]]))
    assert not mixed.audio.any() and not mixed.video.any() and not mixed.text.any()
