"""Which errors of a collective mean "another rank went away" (worker.is_peer_failure, Note [Blame]): every
wording gloo and NCCL use for a reset, closed or timed-out peer, so the rank that hung is blamed, not its peer."""

import pytest

from zerorun.rank.worker import is_peer_failure

PEER = [
    # gloo (third_party/gloo/gloo/transport/tcp/pair.cc and unbound_buffer.cc), as raised on rank 0 when rank 1
    # was SIGSTOPped or killed
    "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:40043",
    "[../third_party/gloo/gloo/transport/tcp/pair.cc:598] Read error [127.0.0.1]:2232: Connection reset by peer",
    "[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 30000ms for recv operation "
    "to complete",
    "[../third_party/gloo/gloo/transport/tcp/pair.cc:446] Application timeout caused pair closure",
    "[../third_party/gloo/gloo/transport/tcp/pair.cc:188] Socket Timeout",
    "[../third_party/gloo/gloo/transport/tcp/pair.cc:598] Socket closed [127.0.0.1]:4411",
    "[../third_party/gloo/gloo/transport/tcp/pair.cc:575] Write error: Broken pipe",
    "[../third_party/gloo/gloo/transport/tcp/pair.cc:144] Connection refused",
    # NCCL (ProcessGroupNCCL.cpp; ncclRemoteError)
    "[Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=7, OpType=ALLREDUCE, NumelIn=4, "
    "NumelOut=4, Timeout(ms)=30000) ran for 30018 milliseconds before timing out.",
    "Some NCCL operations have failed or timed out. Due to the asynchronous nature of CUDA kernels, ...",
    "NCCL communicator was aborted on rank 0.",
    "NCCL error in: ProcessGroupNCCL.cpp:1970, remote process exited or there was a network error, NCCL version "
    "2.21.5\nncclRemoteError: A call failed possibly due to a network error or a remote process exiting prematurely.",
]
OWN = ["mat1 and mat2 shapes cannot be multiplied (4x8 and 16x4)", "CUDA out of memory. Tried to allocate 2.00 GiB",
       "Tensors must have same number of dimensions: got 2 and 3", "bad batch"]


@pytest.mark.parametrize("message", PEER)
def test_gloo_and_nccl_peer_failures(message):
    assert is_peer_failure(RuntimeError(message))


@pytest.mark.parametrize("message", OWN)
def test_own_errors_are_not_peer_failures(message):
    assert not is_peer_failure(RuntimeError(message))
