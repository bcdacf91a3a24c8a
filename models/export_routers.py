"""Exports transformers' DeepSeek-V3 router (DeepseekV3TopkRouter) alone, tiny, for the router tests.

    python models/export_routers.py {torchscript,dynamo} OUT.onnx

Run it with each pinned export environment (transformers 4.57 fills the masked experts with 0.0,
5.x with -inf). H 16, E 8 in 4 groups, 2 groups kept, k 2, renormalized (+1e-20), scaled by 2.5;
the expert bias is drawn from [0, 0.2) (>= 0, so the 0.0 fill never ranks a masked expert first).
Outputs: the top-k weights and indices, in the order the router returns them.
"""

import os
import sys

import onnx
import torch
import transformers
from transformers.models.deepseek_v3 import modeling_deepseek_v3


class RouterResult(torch.nn.Module):
    """The router's weights and indices (transformers 5 also returns the logits first: dropped)."""

    def __init__(self, router):
        super().__init__()
        self.router = router

    def forward(self, hidden_states):
        result = self.router(hidden_states)
        return result[-2:] if len(result) == 3 else result


def main(exporter: str, out: str) -> None:
    config = transformers.DeepseekV3Config(hidden_size=16, n_routed_experts=8, num_experts_per_tok=2, n_group=4,
                                           topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5)
    torch.manual_seed(0)
    router = modeling_deepseek_v3.DeepseekV3TopkRouter(config)
    with torch.no_grad():
        router.weight.normal_(0, 0.5)
        router.e_score_correction_bias.uniform_(0.0, 0.2)
    module = RouterResult(router).eval()
    hidden_states = torch.randn(2, 5, 16)
    torch.onnx.export(module, (hidden_states,), out, dynamo=exporter == "dynamo", opset_version=18,
                      input_names=["hidden_states"], output_names=["first", "second"],
                      dynamic_axes=None if exporter == "dynamo" else {"hidden_states": {0: "batch", 1: "seq"}})
    if os.path.exists(out + ".data"):  # the dynamo exporter writes the weights beside: keep them inside
        onnx.save(onnx.load(out), out, save_as_external_data=False)
        os.remove(out + ".data")


if __name__ == "__main__":
    main(*sys.argv[1:])
