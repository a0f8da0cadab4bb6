"""torchtitan 0.2.2's trainer on the CPU, for a dry run of ``benchmarks/torchtitan/torchtitan_h200.sh``.

torchtitan 0.2.2 assumes a GPU (its device module defaults to ``torch.cuda``); this entry point
points its device helpers at the CPU (gloo), then runs ``torchtitan.train.main`` unchanged.
It checks the script's flow (config, converter, checkpoints, resume, the DCP plan check), not
the GPU numerics: the real run is ``-m torchtitan.train`` on the H200.
"""

import sys
import types

import torch

cpu = types.SimpleNamespace(**{k: getattr(torch.cpu, k) for k in dir(torch.cpu) if not k.startswith("__")})
cpu.get_device_name = lambda *a: "cpu"
cpu.get_device_properties = lambda *a: types.SimpleNamespace(total_memory=2**34)
cpu.reset_peak_memory_stats = cpu.empty_cache = cpu.set_device = lambda *a: None
cpu.current_device = lambda: 0
cpu.memory_stats = lambda *a: {
    "active_bytes.all.peak": 0,
    "reserved_bytes.all.peak": 0,
    "num_alloc_retries": 0,
    "num_ooms": 0,
}

import torchtitan.train  # noqa: E402  (imports every module that copied utils.device_type)

for module in list(sys.modules.values()):
    if getattr(module, "__name__", "").startswith("torchtitan") and hasattr(module, "device_type"):
        module.device_type = "cpu"
        if hasattr(module, "device_module"):
            module.device_module = cpu

torchtitan.train.main(torchtitan.train.Trainer)
