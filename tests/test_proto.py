"""The committed generated code matches the .proto files (regenerate: python proto/generate.py)."""
import subprocess
import sys

from .conftest import REPO


def test_generated_code_matches_proto_files():
    result = subprocess.run([sys.executable, "proto/generate.py", "--check"], cwd=REPO, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_attribute_json_is_orjsons_unless_a_float_is_not_finite():
    """Plain batches (nulls for spans without attributes, None values, text holding 'null')
    are orjson's bytes; a NaN or an infinity anywhere is written as NaN/Infinity."""
    import math

    import orjson

    from crosstrace.proto.attributes_json import dumps

    plain = [None, {"a": 1, "s": '{"x": null} é', "n": None}, {"l": [1.0, None]}, None]
    assert dumps(plain) == orjson.dumps(plain)
    assert dumps([None, {"l": [1.0, math.nan]}, {"d": {"x": -math.inf}}]) == \
        b'\n[null,{"l":[1.0,NaN]},{"d":{"x":-Infinity}}]'     # json's: marked for json to read back
    assert dumps([{"big": 1 << 70, "s": "é", "x": math.inf}]) == \
        '\n[{"big":1180591620717411303424,"s":"é","x":Infinity}]'.encode()
