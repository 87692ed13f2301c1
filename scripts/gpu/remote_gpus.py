"""Remote training on a GPU machine, checked on that machine itself: the machine reaches itself through a throwaway
sshd on 127.0.0.1 (modules/remote/local_sshd.py; needs OpenSSH's sshd installed there, else it says so and stops).

    python scripts/gpu/remote_gpus.py [--steps 20]

Checks that the remote set-up check lists the GPUs nvidia-smi lists, and that the demo started through
scripts/train_remote.py with --num-gpus 0 trains on all of them (world size = GPUs), ends, and its model is
fetched (on a machine without GPUs: 2 CPU processes, to try the script). Uses the running Python as the remote's ("existing Python" option: no install, no network needed).
Prints a table last.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=20)
    args = p.parse_args()
    from modules.remote.local_sshd import SshServer, sshd_problem
    from modules.remote.session import RemoteSession

    problem = sshd_problem()
    if problem:
        print(f"skipped: {problem}")
        return 0
    try:
        listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout
    except FileNotFoundError:
        listed = ""  # a machine without the NVIDIA driver: the run trains on CPU processes
    gpus = len([line for line in listed.splitlines() if line.startswith("GPU ")])
    tmp = Path(tempfile.mkdtemp(prefix="tandem-remote-gpus-"))
    server = SshServer(tmp / "sshd").start()
    try:
        server.trust()
        host = server.remote(tmp / "remote", python=sys.executable)
        report = RemoteSession([host], server.known(), progress=lambda text: None).check()[0]
        print(report.message())
        key = subprocess.run(["ssh-keygen", "-lf", f"{server.host_key}.pub"], capture_output=True,
                             text=True).stdout.split()[1]
        command = [sys.executable, str(REPO / "scripts" / "train_remote.py"), "--host",
                   f"{host.user}@127.0.0.1:{server.port}", "--identity", str(server.user_key), "--remote-folder",
                   str(tmp / "remote"), "--remote-python", sys.executable, "--accept-host-key", key,
                   "--config-path", "#demo", *(["--num-gpus", "0"] if gpus else ["--device", "cpu", "--num-gpus", "2"]),
                   "--config-value", f"training.max_steps={args.steps}",
                   "--config-value", f"general.workspace_dir={tmp / 'ws'}", "--config-value", "sampling.every_n_epochs=0"]
        done = subprocess.run(command, capture_output=True, text=True, cwd=REPO, timeout=1800,
                              env=dict(os.environ, TANDEM_HOME=str(tmp / "home")))
        print(done.stdout[-4000:], done.stderr[-4000:], sep="\n")
        logs = list((tmp / "remote" / "runs").glob("*/output.log"))
        events = [json.loads(line[len("@tandem "):]) for log in logs for line in log.read_text().splitlines()
                  if line.startswith("@tandem {")]
        world = next((e["world_size"] for e in events if e["type"] == "config"), None)
        finished = [e for e in events if e["type"] == "done"]
        fetched = list((tmp / "ws" / "remote").glob("*/output/demo/unet/diffusion_pytorch_model.safetensors"))
    finally:
        server.stop()
    rows = [("nvidia-smi GPUs", gpus), ("remote check GPUs", report.gpu_count), ("run world size", world),
            ("run exit code", done.returncode), ("steps done", finished[-1]["step"] if finished else None),
            ("model fetched", bool(fetched))]
    # no GPU (trying the script on a CPU machine): --num-gpus 0 means 2 CPU processes
    ok = report.gpu_count == gpus and world == (gpus or 2) and done.returncode == 0 and bool(fetched)
    print("\n| check | value |\n| --- | --- |")
    for name, value in rows:
        print(f"| {name} | {value} |")
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
