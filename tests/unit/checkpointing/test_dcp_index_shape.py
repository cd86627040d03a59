"""core/checkpointing/dcp_index.check_shape: every part of a DCP Metadata it reads back (the state dict entries,
the storage map, the fields describing the save) is checked, each malformation refused with its own message."""

import pytest
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from core.checkpointing.dcp_index import UnsafeCheckpoint, check_shape


def well_formed() -> Metadata:
    chunk = ChunkStorageMetadata(offsets=torch.Size([0]), sizes=torch.Size([4]))
    return Metadata(
        state_dict_metadata={
            "w": TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size([4]), [chunk]),
            "step": BytesStorageMetadata(),
        },
        storage_data={MetadataIndex("w", torch.Size([0])): _StorageInfo("__0_0.distcp", 0, 16)},
        storage_meta=StorageMeta(),
        planner_data={"w": ("w",)},
        version="1",
    )


MALFORMED = {
    "a state dict key of type int": lambda m: m.state_dict_metadata.update({3: BytesStorageMetadata()}),
    "'w' has malformed tensor properties": lambda m: setattr(
        m.state_dict_metadata["w"], "properties", TensorProperties(dtype="float32")
    ),
    "'w' has a chunk outside its size": lambda m: setattr(
        m.state_dict_metadata["w"], "chunks", [ChunkStorageMetadata(torch.Size([2]), torch.Size([4]))]
    ),
    "a malformed storage key": lambda m: m.storage_data.update({"w": _StorageInfo("__0_0.distcp", 0, 16)}),
    "storage of 'w': not a file of the folder": lambda m: m.storage_data.update(
        {MetadataIndex("w"): _StorageInfo("../elsewhere", 0, 16)}
    ),
    "compressed": lambda m: setattr(next(iter(m.storage_data.values())), "transform_descriptors", ["gzip"]),
    "malformed storage_meta": lambda m: setattr(m, "storage_meta", {"modules": []}),
    "malformed version": lambda m: setattr(m, "version", 1),
    "malformed planner_data": lambda m: setattr(m, "planner_data", {"w": 1}),
}


def test_well_formed_metadata_passes():
    check_shape(well_formed())


@pytest.mark.parametrize("message", MALFORMED)
def test_each_malformed_part_is_refused_by_name(message):
    index = well_formed()
    MALFORMED[message](index)
    with pytest.raises(UnsafeCheckpoint, match=message):
        check_shape(index)
