"""Tandem's remote folder belongs to its user alone.

Every remote command runs under `umask 077` (`ssh.Ssh.command`), and the runs it starts inherit it, so what
Tandem and its runs create there is 0700 (folders) or 0600 (files). A folder that an older Tandem made, or one
made by hand, may still be open to others: the check (`prepare.check`, before every start) closes it once,
together with Tandem's folders in it - uploaded data and models, outputs, logs, run records - and says when it
cannot (a folder owned by another user).
"""
from __future__ import annotations

from .machine import RemoteMachine

TANDEM_FOLDERS = ("source", "venv", "files", "work", "runs", "home")
"""What Tandem keeps in its remote folder (docs/Remote.md); only these are closed, never anything else there."""
PRIVATE_LISTING = "d???------*"
"""`ls -ldL` of a folder that only its owner may enter, read or write (an ACL or SELinux mark may follow)."""


def make_private_script(machine: RemoteMachine) -> str:
    """sh lines that close the remote folder when it is open to others and print `folder_private=yes|no`."""
    folder = machine.path()
    inside = " ".join(machine.path(name) for name in TANDEM_FOLDERS)
    return f"""case "$(ls -ldL {folder} 2>/dev/null)" in
  {PRIVATE_LISTING}) ;;
  *) chmod -R go-rwx {inside} 2>/dev/null; chmod 700 {folder} 2>/dev/null ;;
esac
case "$(ls -ldL {folder} 2>/dev/null)" in {PRIVATE_LISTING}) echo folder_private=yes ;; *) echo folder_private=no ;; esac
"""
