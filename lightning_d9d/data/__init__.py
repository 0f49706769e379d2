"""Data-pipeline helpers: documents packed into fixed-length rows with their boundaries (``packing.py``), and
conversations turned into documents whose loss learns only the assistant's turns (``chat.py``)."""

from lightning_d9d.data.chat import chat_documents
from lightning_d9d.data.packing import Document, PackedDataset, pack_documents

__all__ = ["Document", "PackedDataset", "chat_documents", "pack_documents"]
