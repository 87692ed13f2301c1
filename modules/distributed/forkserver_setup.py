"""Imported first by the spawn launcher's forkserver (`processes.PRELOADED`), and by nothing else.

Three settings of the server process; its workers undo the first and the last
(`processes._undo_the_forkserver_settings`), and a fork does not inherit the second:

- SIGTERM ignored. The forkserver is the parent of every worker, and each worker dies with its parent
  (`end_with_parent`). A SIGTERM to the launch's process group - what a job scheduler or the GUI's
  "terminate" sends - must reach the workers as a clean stop (each backs up at the same step), not end the
  server and so kill the workers mid-step. The server still ends when the launcher does (multiprocessing
  closes its pipe).
- It dies with the launcher (the parent-death signal, SIGKILL). The launcher's end closes the pipe the server
  watches, but the server then leaves like any interpreter, tearing down torch, diffusers and transformers:
  2.8-16.4 s on a busy machine, during which the workers - who die with the server, not with the launcher -
  trained on and wrote backups. Killed, it takes them with it at once. (Should the launcher be gone before
  this line ran, the server sees the closed pipe before any request and forks no worker.)
- CUDA asked about through NVML only. diffusers asks at import whether a GPU is there
  (`torch.accelerator.is_available()`); PyTorch's default answer initialises the CUDA driver, after which no
  forked child can use CUDA ("Cannot re-initialize CUDA in forked subprocess"). NVML answers without it.

It also keeps the installed packages' map (`modules/util/package_map.py`) and transformers' scan of its model
folders (`modules/util/import_structure.py`) before the server imports diffusers and transformers, which the
workers inherit as they are.
"""
import os
import signal

from modules.util.exit import die_with_parent
from modules.util.import_structure import remember_import_structure
from modules.util.package_map import remember_package_map

NVML_CHECK = "PYTORCH_NVML_BASED_CUDA_CHECK"
users_nvml_check = os.environ.get(NVML_CHECK)
"""The user's own value, which the workers get back."""

server_pid = os.getpid()
"""The server's pid, which the workers forked from it inherit: the parent each must still have as it starts."""

signal.signal(signal.SIGTERM, signal.SIG_IGN)
die_with_parent()
os.environ[NVML_CHECK] = "1"
remember_package_map()
remember_import_structure()
