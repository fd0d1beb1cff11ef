"""Check a UI-format workflow (frontend format 0.4) against a live server's ``/object_info``.

What the frontend would trip over when loading the file, or the backend when running its export:
unknown node types, links whose type differs from the output or the input they join, sockets that do
not exist, required sockets left open, ``widgets_values`` whose count or values do not fit the input
specs in order (with the frontend-only entries after a control_after_generate widget and after an
image upload combo), combo values missing from the live lists, numbers outside min/max.
"""

from __future__ import annotations

from typing import Any

VIRTUAL_NODES = {"Note", "MarkdownNote", "PrimitiveNode", "Reroute"}  # frontend-only, not in /object_info
WIDGET_TYPES = {"INT", "FLOAT", "STRING", "BOOLEAN", "COMBO"}
CONTROL_VALUES = {"fixed", "increment", "decrement", "randomize"}


def _inputs(info: dict) -> list[tuple[str, Any, dict, bool]]:
    """(name, type, options, optional) in the order the frontend shows them."""
    out = []
    for group in ("required", "optional"):
        for name in info.get("input_order", {}).get(group, []):
            spec = info["input"][group][name]
            out.append((name, spec[0], spec[1] if len(spec) > 1 else {}, group == "optional"))
    return out


def _is_widget(typ: Any, opts: dict) -> bool:
    return (isinstance(typ, list) or typ in WIDGET_TYPES) and not opts.get("forceInput")


def _value_problem(name: str, typ: Any, opts: dict, value: Any) -> str | None:
    if isinstance(typ, list) or typ == "COMBO":
        options = typ if isinstance(typ, list) else opts.get("options", [])
        return None if value in options else f"{name}: {value!r} is not in the live list {options[:10]}"
    if typ in ("INT", "FLOAT"):
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not number or (typ == "INT" and value != int(value)):
            return f"{name}: {value!r} is not a valid {typ}"
        if ("min" in opts and value < opts["min"]) or ("max" in opts and value > opts["max"]):
            return f"{name}: {value} is outside [{opts.get('min')}, {opts.get('max')}]"
        return None
    if typ == "STRING":
        return None if isinstance(value, str) else f"{name}: {value!r} is not a string"
    if typ == "BOOLEAN":
        return None if isinstance(value, bool) else f"{name}: {value!r} is not a boolean"
    return None


def check_ui_workflow(workflow: dict, object_info: dict) -> list[str]:
    """Problems found (empty when the workflow fits the live node definitions)."""
    problems: list[str] = []
    nodes = {n["id"]: n for n in workflow["nodes"]}
    for node in workflow["nodes"]:
        where = f"node {node['id']} ({node['type']})"
        if node["type"] in VIRTUAL_NODES:
            continue
        info = object_info.get(node["type"])
        if info is None:
            problems.append(f"{where}: no such node type on the server")
            continue
        specs = _inputs(info)
        sockets = {n: (t, opt) for n, t, o, opt in specs if not _is_widget(t, o)}
        widgets = [(n, t, o) for n, t, o, _ in specs if _is_widget(t, o)]
        # sockets
        seen = set()
        for inp in node["inputs"]:
            if "widget" in inp:  # a widget turned into a socket
                if inp["widget"].get("name") not in {w[0] for w in widgets}:
                    problems.append(f"{where}: input {inp['name']} names an unknown widget")
                continue
            if inp["name"] not in sockets:
                problems.append(f"{where}: input {inp['name']} does not exist")
                continue
            seen.add(inp["name"])
            if inp["type"] != sockets[inp["name"]][0]:
                problems.append(f"{where}: input {inp['name']} is {inp['type']}, the server says "
                                f"{sockets[inp['name']][0]}")
            if inp.get("link") is None and not sockets[inp["name"]][1]:
                problems.append(f"{where}: required input {inp['name']} is not linked")
        missing = [n for n, (_, opt) in sockets.items() if not opt and n not in seen]
        if missing:
            problems.append(f"{where}: required inputs missing: {missing}")
        # outputs
        got = [(o["name"], o["type"]) for o in node["outputs"]]
        want = list(zip(info["output_name"], info["output"], strict=True))
        if [t for _, t in got] != [t for _, t in want]:
            problems.append(f"{where}: outputs {got} != server {want}")
        # widgets, positionally
        values = list(node.get("widgets_values", []))
        expected = []
        for name, typ, opts in widgets:
            expected.append(("value", name, typ, opts))
            if opts.get("control_after_generate"):
                expected.append(("control", name, None, {}))
            if opts.get("image_upload"):
                expected.append(("upload", name, None, {}))
        if len(values) != len(expected):
            problems.append(f"{where}: {len(values)} widget values, the server's inputs need {len(expected)} "
                            f"({[e[1] + ('' if e[0] == 'value' else '/' + e[0]) for e in expected]})")
            continue
        for value, (kind, name, typ, opts) in zip(values, expected, strict=True):
            if kind == "control" and value not in CONTROL_VALUES:
                problems.append(f"{where}: {name}: control_after_generate value {value!r}")
            elif kind == "upload" and value != "image":
                problems.append(f"{where}: {name}: upload widget value {value!r}")
            elif kind == "value" and (p := _value_problem(name, typ, opts, value)):
                problems.append(f"{where}: {p}")
    for link_id, src, src_slot, dst, dst_slot, typ in workflow["links"]:
        where = f"link {link_id}"
        if src not in nodes or dst not in nodes:
            problems.append(f"{where}: joins a missing node")
            continue
        src_info = object_info.get(nodes[src]["type"])
        outputs = src_info["output"] if src_info is not None else None
        if outputs is not None and (src_slot >= len(outputs) or outputs[src_slot] != typ):
            problems.append(f"{where}: {typ} does not match output {src_slot} of {nodes[src]['type']}")
        dst_inputs = nodes[dst]["inputs"]
        arrives = dst_slot < len(dst_inputs) and dst_inputs[dst_slot]["link"] == link_id
        takes = dst_inputs[dst_slot]["type"] if arrives else ""
        if not arrives or (takes != "*" and typ not in takes.split(",")):  # "*" any type, "A,B" either
            problems.append(f"{where}: does not arrive at input {dst_slot} of node {dst} as {typ}")
    return problems
