import onnx.defs

import moe_onnx


def test_schemas_registered():
    assert onnx.defs.has("MOE", 1, moe_onnx.DOMAIN)
