"""Imported first by the spawn launcher's forkserver (`processes.PRELOADED`), and by nothing else.

Two settings of the server process that its workers must not keep (`processes._undo_the_forkserver_settings`):

- SIGTERM ignored. The forkserver is the parent of every worker, and each worker dies with its parent
  (`end_with_parent`). A SIGTERM to the launch's process group - what a job scheduler or the GUI's
  "terminate" sends - must reach the workers as a clean stop (each backs up at the same step), not end the
  server and so kill the workers mid-step. The server still ends when the launcher does (multiprocessing
  closes its pipe).
- CUDA asked about through NVML only. diffusers asks at import whether a GPU is there
  (`torch.accelerator.is_available()`); PyTorch's default answer initialises the CUDA driver, after which no
  forked child can use CUDA ("Cannot re-initialize CUDA in forked subprocess"). NVML answers without it.

It also keeps the installed packages' map (`modules/util/package_map.py`) and transformers' scan of its model
folders (`modules/util/import_structure.py`) before the server imports diffusers and transformers, which the
workers inherit as they are.
"""
import os
import signal

from modules.util.import_structure import remember_import_structure
from modules.util.package_map import remember_package_map

NVML_CHECK = "PYTORCH_NVML_BASED_CUDA_CHECK"
users_nvml_check = os.environ.get(NVML_CHECK)
"""The user's own value, which the workers get back."""

signal.signal(signal.SIGTERM, signal.SIG_IGN)
os.environ[NVML_CHECK] = "1"
remember_package_map()
remember_import_structure()
