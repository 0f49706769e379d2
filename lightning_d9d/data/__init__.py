"""Data-pipeline helpers: documents packed into fixed-length rows with their boundaries (``packing.py``)."""

from lightning_d9d.data.packing import Document, PackedDataset, pack_documents

__all__ = ["Document", "PackedDataset", "pack_documents"]
