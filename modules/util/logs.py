"""How Tandem's processes log: rank 0 tells INFO on stdout, other ranks only warnings and errors on stderr.

Every process that trains or launches calls `setup_logging` first. The data scan's warnings (what it
skipped, resized or ignored) come from one process per run: the launcher, which scans the data once and
hands the scan to its workers, or rank 0 where each rank scans for itself (a user's own torchrun).
"""
from __future__ import annotations

import logging
import os
import re
import sys
import warnings


def setup_logging() -> None:
    """Rank 0 logs INFO to stdout; other ranks only warnings and errors, tagged with their rank."""
    rank = int(os.environ.get("RANK", "0"))
    logger = logging.getLogger("tandem")
    logger.handlers.clear()
    handler = logging.StreamHandler(sys.stdout if rank == 0 else sys.stderr)
    prefix = "" if rank == 0 else f"[rank {rank}] "
    handler.setFormatter(logging.Formatter(prefix + "%(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    logger.propagate = False
    logging.getLogger("modules.data.concepts").setLevel(logging.NOTSET if rank == 0 else logging.ERROR)
    quiet_libraries()


def quiet_libraries() -> None:
    """Keep the libraries' notices that say nothing to a Tandem user out of the log.

    transformers warns that image processors fall back to PIL without torchvision (Tandem needs no image
    processor), diffusers that a `.to(dtype)` cast could touch modules "kept in float32" (Tandem casts
    frozen parts on purpose, and prints the list even when it is empty); their weight-loading progress
    bars would fill a log file with carriage returns. torch.compile warns, once per call site, that
    diffusers' upsampling calls an `lru_cache` function it does not trace (a version check: nothing to
    trace; 20 lines per compile on H100 hosts). Only those messages are filtered: warnings that matter
    (missing weights, errors) pass. Nothing is imported here: the launcher process never needs these
    libraries, and importing them costs seconds.
    """
    for name, text in (("transformers.utils.import_utils", "requires torchvision"),
                       ("diffusers.models.modeling_utils", "should be kept in float32")):
        logging.getLogger(name).addFilter(lambda record, text=text: text not in record.getMessage())
    warnings.filterwarnings("ignore", message=re.escape("Dynamo detected a call to a `functools.lru_cache`-wrapped function"),
                            category=UserWarning)
    if not sys.stderr.isatty():
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # read by transformers when it loads
