"""resilient.storage: the checkpoint runtime (``storage/offline``: the offline tools).

Importing it registers bfloat16 with zarr-python, so that every array of a checkpoint opens with
plain ``zarr.open`` (``import resilient.storage, zarr``); the package face ``resilient`` defers this
import until the checkpoint API is first used.
"""

from resilient.dtypes import register_zarr_bfloat16 as _register_zarr_bfloat16

_register_zarr_bfloat16()
