import os
import sys

sys.path.insert(0, os.path.dirname(__file__))


# The longest files first: the pytest-xdist workers take whole files in collection
# order, so the long ones start early instead of leaving one worker alone at the end.
HEAVY_FIRST = [  # by their time in a suite run, longest first
    "test_train_example.py", "test_tensor_parallel.py", "test_moe.py", "test_training_parity.py", "test_estimate.py",
    "test_cpu_offload.py", "test_optimizer.py", "test_nd_checkpoint.py", "test_leaks.py", "test_compile.py",
    "test_muon.py", "test_gpu_check.py", "test_patch.py", "test_pipeline.py", "test_train_example_moe.py",
    "test_quant.py", "test_docs.py", "test_accelerator_path.py", "test_float8.py", "test_plan.py", "test_extension.py",
    "test_nd_meshes.py", "test_threaded.py", "test_patch_hf.py", "test_state_dict.py", "test_train_example_quant.py",
    "test_train_example_plan.py", "test_plan_moe.py",
]


def pytest_collection_modifyitems(config, items) -> None:  # noqa: ANN001 - pytest's hook
    order = {name: i for i, name in enumerate(HEAVY_FIRST)}
    items.sort(key=lambda item: order.get(item.path.name, len(order)))  # stable: the rest keep theirs
