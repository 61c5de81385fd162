"""Which backends the model's two seams (`model/backends.py`: experts, head loss) use on the device a model is built
for: on a CPU the CPU package's kernels (`moetron.cpu`), elsewhere ATen's ops. A GPU run never imports the CPU
package."""

from __future__ import annotations

import torch


def use_device_backends(device: torch.device | str) -> None:
    """Register the device type's backends (once is enough; again changes nothing)."""
    if torch.device(device).type == "cpu":
        from moetron.cpu import use_cpu_backends  # here: only a CPU run loads the CPU package

        use_cpu_backends()
