"""Concept folders -> batches: scan, captions, aspect buckets, latent/text cache, batch sampler."""
from .buckets import CropPlan, closest_bucket, load_pixels, make_buckets, plan_crop
from .cache import CacheIndex, CacheItem, fill_cache
from .concepts import (EmptyDatasetError, ImageRecord, ScanResult, process_caption, read_caption,
                       scan_concept, scan_concepts)
from .dataset import TrainDataset, build_dataset, collate, make_dataloader, text_cache_allowed, text_cache_refusal
from .builtin_datasets import resolve_concept_path
from .demo_dataset import DEMO_SCHEME, ensure_demo_dataset
from .masks import MaskError
from .sampler import BucketBatchSampler
