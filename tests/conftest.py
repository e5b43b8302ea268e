import os

import pytest
import torch

# Without a GPU, Triton's interpreter runs this project's kernels on CPU tensors
# (tests/test_ns_backends.py); it must be chosen before triton is first imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(scope="module")
def kernels():
    """:mod:`muoneq.ns_triton`, its kernels in Triton's interpreter (asked for above where there
    is no GPU) on CPU tensors, the interpreter's bf16 arithmetic corrected
    (:mod:`tests.helpers.triton_interpreter`)."""
    pytest.importorskip("triton")
    from muoneq import ns_triton
    from tests.helpers.triton_interpreter import corrected

    if not ns_triton._interpreted():
        pytest.skip("the Triton kernels run on CPU only in Triton's interpreter")
    with corrected():
        yield ns_triton


@pytest.fixture
def one_thread():
    """Tiny models run fastest on one thread (and bitwise reproducibly); on a busy shared CPU
    several threads spin. Modules opt in with ``pytestmark = pytest.mark.usefixtures(...)``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
