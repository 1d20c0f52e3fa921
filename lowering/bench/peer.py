"""The peer: what a user gets without oplower (issue 15).

PyTorch's own decomposition of ``native_batch_norm_backward`` (``torch._decomp``), exported to ONNX with the
TorchScript exporter (``torch.onnx.export(..., dynamo=False, opset_version=17)``) and run on the same
onnxruntime as the lowering. Built only when torch is importable; torch is never a dependency.

NCX: the module takes NCHW tensors. NXC: it takes NHWC tensors and views them as NCHW (``permute``), as a
channels-last user would write it; the export turns those views into Transposes, which the peer pays for.
"""

from __future__ import annotations

import io
import warnings

import onnx

PEER_INPUTS = ("diff_dst", "src", "gamma", "mean", "inv_std")
PEER_OUTPUTS = ("diff_src", "diff_gamma", "diff_beta")


def peer_model(torch, shape: tuple[int, ...], layout: str, epsilon: float = 1e-5) -> onnx.ModelProto:
    """The exported decomposition for an f32 input of ``shape`` (NCHW for NCX, NHWC for NXC)."""
    from torch._decomp import decompositions

    channel_last = layout == "NXC"

    class Peer(torch.nn.Module):
        def forward(self, dy, x, gamma, mean, inv_std):
            if channel_last:
                dy, x = dy.permute(0, 3, 1, 2), x.permute(0, 3, 1, 2)
            dx, dgamma, dbeta = decompositions.native_batch_norm_backward(
                dy, x, gamma, None, None, mean, inv_std, True, epsilon, [True, True, True])
            if channel_last:
                dx = dx.permute(0, 2, 3, 1)
            return dx, dgamma, dbeta

    channels = shape[-1] if channel_last else shape[1]
    args = (torch.randn(shape), torch.randn(shape), torch.ones(channels), torch.zeros(channels),
            torch.ones(channels))
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the legacy exporter's deprecation notice
        torch.onnx.export(Peer(), args, buffer, dynamo=False, opset_version=17, input_names=list(PEER_INPUTS),
                          output_names=list(PEER_OUTPUTS))
    return onnx.load_from_string(buffer.getvalue())
