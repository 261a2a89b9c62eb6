"""Site data: sources (digits, MedMNIST-style .npz, ImageFolder), loaders, partitioners, augmentations."""

from p2pfl.learning.data.loaders import (
    SiteData,
    convert_images,
    load_site_data,
    site_data_from_arrays,
    stratified_split,
    to_float_tensor,
    to_uint8_images,
)
from p2pfl.learning.data.sources import DataError, RawSplits, read_source

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
