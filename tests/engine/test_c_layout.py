"""The ctypes structures `agentrt.engine.cpu_ops` passes to the C kernels against their C
declarations: a probe compiled from the library's own headers, with the library's flags, exports
each struct's size and every field's offset and size, and the ctypes mirror must agree on all of
them. Every ``ctypes.Structure`` of the module is checked; ``_Name`` mirrors the C ``Name``."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import pytest

from agentrt.engine import cpu_ops

CSRC = Path(cpu_ops.__file__).parent / "csrc"
STRUCTS = {name: value for name, value in vars(cpu_ops).items()
           if isinstance(value, type) and issubclass(value, ctypes.Structure)}
# Other C facts the Python side relies on: the GGUF block kinds and the KV cache's element size.
CONSTANTS = {"GGUF_Q4_1": "GGUF_Q4_1", "GGUF_Q8_0": "GGUF_Q8_0", "sizeof(kv_t)": "sizeof(kv_t)"}


def c_name(python_name: str) -> str:
    return python_name.removeprefix("_")


def layout_expressions() -> dict[str, str]:
    """What the probe evaluates, by the key the tests look it up with."""
    found = dict(CONSTANTS)
    for name, struct in STRUCTS.items():
        c = c_name(name)
        found[f"sizeof({c})"] = f"sizeof({c})"
        for field, *_ in struct._fields_:
            found[f"offsetof({c}, {field})"] = f"offsetof({c}, {field})"
            found[f"sizeof({c}.{field})"] = f"sizeof((({c} *)0)->{field})"
    return found


@pytest.fixture(scope="module")
def c_layout(tmp_path_factory) -> dict[str, int]:
    if shutil.which("gcc") is None:
        pytest.skip("no gcc here: the kernels are not built either")
    expressions = layout_expressions()
    folder = tmp_path_factory.mktemp("layout")
    includes = "".join(f'#include "{header.name}"\n' for header in sorted(CSRC.glob("*.h")))
    (folder / "probe.c").write_text(
        f"#include <stddef.h>\n{includes}\nconst long long LAYOUT[] = {{\n"
        + "".join(f"    (long long)({expr}),\n" for expr in expressions.values()) + "};\n")
    out = folder / "probe.so"
    built = subprocess.run(["gcc", *cpu_ops._GCC_FLAGS, f"-I{CSRC}", str(folder / "probe.c"),
                            "-o", str(out)], capture_output=True, text=True, timeout=120)
    if built.returncode != 0:
        pytest.fail(f"the layout probe does not compile against csrc/*.h:\n{built.stderr}")
    values = (ctypes.c_longlong * len(expressions)).in_dll(ctypes.CDLL(str(out)), "LAYOUT")
    return dict(zip(expressions, values, strict=True))


def test_the_module_passes_these_structures():
    # a new structure is checked as soon as it exists; this names the ones known today
    assert {c_name(name) for name in STRUCTS} >= {"Matrix", "Layer", "Seq"}


@pytest.mark.parametrize("name", sorted(STRUCTS))
def test_structure_matches_its_c_declaration(c_layout, name):
    struct, c = STRUCTS[name], c_name(name)
    wrong = []
    if ctypes.sizeof(struct) != c_layout[f"sizeof({c})"]:
        wrong.append(f"sizeof: ctypes {ctypes.sizeof(struct)}, C {c_layout[f'sizeof({c})']}")
    for field, *_ in struct._fields_:
        descriptor = getattr(struct, field)
        offset, size = c_layout[f"offsetof({c}, {field})"], c_layout[f"sizeof({c}.{field})"]
        if (descriptor.offset, descriptor.size) != (offset, size):
            wrong.append(f"{field}: ctypes offset {descriptor.offset} size {descriptor.size}, "
                         f"C offset {offset} size {size}")
    assert not wrong, f"{name} does not match {c} in csrc/*.h:\n" + "\n".join(wrong)


def test_block_kinds_and_cache_element_match_c(c_layout):
    assert cpu_ops._PACKED_KINDS == {"q4_1": c_layout["GGUF_Q4_1"], "q8_0": c_layout["GGUF_Q8_0"]}
    assert cpu_ops.CACHE_DTYPE.itemsize == c_layout["sizeof(kv_t)"]


def test_the_library_covers_every_unit_and_its_key_every_header():
    # a .c file left out of _SOURCES would not be built; a header left out of the key would let
    # an edited header reuse a stale library
    assert set(cpu_ops._SOURCES) == {path.name for path in CSRC.glob("*.c")}
    assert set(cpu_ops._c_sources()) == {path.name for path in CSRC.glob("*.[ch]")}
