"""Training on remote machines over SSH, driven from the desktop (GUI or scripts/train_remote.py).

Everything goes through the system's OpenSSH client (`ssh`, `ssh-keyscan`, `ssh-keygen`), which Linux,
macOS and Windows 10+ ship: no transport of Tandem's own. Files travel as tar streams through `ssh`
(Python's tarfile on the desktop, `tar` on the remote), so nothing beyond the OpenSSH client is needed on
the desktop. Torch-free: the GUI imports it.

The remote folder (a `RemoteHost.folder`) holds:

    source/<version>/   the desktop's Tandem at its version (tracked files, `source.py`); .venv -> ../../venv
    venv/               Tandem's own environment, made by the README's install.sh (unless `RemoteHost.python`)
    files/              uploaded datasets and models, with files/manifest.json (content hashes, `uploads.py`)
    work/<workspace>/   each desktop workspace's remote twin: backups, outputs, samples, TensorBoard logs
    runs/<run id>/      one started run: config.json, output.log (its stdout: log and `@tandem` events),
                        run.json (the registry entry), exit.json once it ended (`remote_side.py`)
    home/               TANDEM_HOME of the runs (built-in demo models)

Modules: `host` (the connection settings), `ssh` (command lines and their errors), `known_hosts` (host keys),
`source` (what is shipped), `machine` (one remote's folders and Python, calls of remote_side), `prepare` (the
set-up check and install), `uploads`, `remote_config` (the config as the remote runs it), `runs` (start, list,
follow, commands, stop), `fetch` (outputs), `tunnel` (TensorBoard), `session` (the steps of a start in order,
for the CLI and the GUI), `cli`, `remote_side` (the helper that runs on the remote machine) and `local_sshd`
(a throwaway sshd on 127.0.0.1 for the tests and the documentation's pictures).
"""
