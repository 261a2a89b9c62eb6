"""Site data: loaders (digits, MedMNIST-style .npz, ImageFolder), partitioners, augmentations."""

from p2pfl.learning.data.loaders import (
    DataError,
    RawSplits,
    SiteData,
    convert_images,
    load_site_data,
    read_source,
    site_data_from_arrays,
    stratified_split,
    to_float_tensor,
    to_uint8_images,
)

__all__ = [
    "DataError",
    "RawSplits",
    "SiteData",
    "convert_images",
    "load_site_data",
    "read_source",
    "site_data_from_arrays",
    "stratified_split",
    "to_float_tensor",
    "to_uint8_images",
]
