"""Use resilient from PyTorch DCP: ``dcp.save(state, storage_writer=StorageWriter(url, step=N))``,
``dcp.load(state, storage_reader=StorageReader(url))``; with ``planner=SavePlanner()`` /
``LoadPlanner()``, non-tensor values are stored as JSON or raw bytes instead of pickles.

The public face only (like the package's ``__init__``): the code lives in ``resilient.storage.dcp``.
"""

from resilient.storage.dcp import LoadPlanner, SavePlanner, StorageReader, StorageWriter

__all__ = ["LoadPlanner", "SavePlanner", "StorageReader", "StorageWriter"]
