"""PyTorch DCP storage plugins and planners over resilient's format (the public face is ``resilient.dcp``)."""

from resilient.storage.dcp.planner import LoadPlanner, SavePlanner
from resilient.storage.dcp.reader import StorageReader
from resilient.storage.dcp.writer import StorageWriter

__all__ = ["LoadPlanner", "SavePlanner", "StorageReader", "StorageWriter"]
