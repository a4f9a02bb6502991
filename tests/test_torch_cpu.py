"""PyTorch on the CPU in channels-last layout and chunks (deploykit.torch_cpu): same numbers as
the plain call, and the fallbacks for models that cannot take either."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from deploykit.runners import TorchRunner  # noqa: E402
from deploykit.torch_cpu import CPU_CHUNK  # noqa: E402


def _net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(),
                               torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(),
                               torch.nn.Linear(8, 5))


def test_channels_last_chunks_give_the_plain_logits_within_fp32_rounding():
    x = np.random.RandomState(0).randn(CPU_CHUNK * 2 + 3, 3, 20, 20).astype(np.float32)
    net = _net().eval()
    with torch.no_grad():
        ref = net(torch.from_numpy(x)).numpy()
    r = TorchRunner(net)
    out = r.infer({"input": x})["logits"]
    assert out.shape == ref.shape
    np.testing.assert_allclose(out, ref, rtol=0, atol=1e-5)
    assert r.channels_last is True and r.chunked is True
    assert r.describe()["memory_format"] == "channels_last"
    # the module stays usable by autograd, and close() gives it back in its own layout
    # (stage 2 exports it after its parity run)
    y = net(torch.from_numpy(x[:2]).requires_grad_())
    y.sum().backward()
    r.close()
    assert net[0].weight.is_contiguous()
    assert not net[0].weight.is_contiguous(memory_format=torch.channels_last)


class _ViewNet(torch.nn.Module):
    """Calls .view on a conv output (fails in channels-last) and sums over the batch."""

    def __init__(self):
        super().__init__()
        self.c = torch.nn.Conv2d(3, 4, 3)

    def forward(self, x):
        y = self.c(x)
        return y.view(y.shape[0], -1).sum(0)


def test_a_model_that_cannot_take_channels_last_or_chunks_runs_whole_and_plain():
    x = np.random.RandomState(1).randn(CPU_CHUNK + 4, 3, 8, 8).astype(np.float32)
    net = _ViewNet().eval()
    with torch.no_grad():
        ref = net(torch.from_numpy(x)).numpy()
    r = TorchRunner(net)
    out = r.infer({"input": x})["logits"]
    assert r.channels_last is False and r.chunked is False
    np.testing.assert_allclose(out, ref, rtol=1e-6, atol=1e-5)  # the whole batch's sum
    assert r.describe()["memory_format"] == "contiguous (NCHW)"
