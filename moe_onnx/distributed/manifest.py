"""A shard's manifest (``DIR/shard.json``) and the fingerprints that tie the rank models to it.

``moe-onnx shard`` writes the manifest; the runner (``moe_onnx.distributed.run``) checks every rank's model
against it and against the other ranks' before running (docs/distributed.md, "Running it"). Everything here
reads only the models' graphs (never their weights), so the checks cost little for a multi-GB model.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path

import onnx
from onnx import helper

from .._ir import model_files
from ..ops import DOMAIN

#: the version of shard.json's layout
MANIFEST_FORMAT = 1
MANIFEST_NAME = "shard.json"
#: metadata_props key of a rank model: the JSON of its place in the shard (source fingerprint, tp, ep, rank)
METADATA_KEY = "moe_onnx.shard"
#: the ops whose attributes carry a rank layout (docs/distributed.md)
DISTRIBUTED_OPS = ("MOE", "MoeRowParallelLinear", "MoeDistributeDispatch", "MoeDistributeCombine")
_RANK_ATTRS = ("ep_rank_id", "tp_rank_id")
#: attributes that name a TP rank's slice width (an uneven I split gives the TP ranks different ones): compared
#: with the weights' shapes, within an EP group
_SLICE_ATTRS = ("in_features", "out_features")


class ManifestError(ValueError):
    """A shard directory whose manifest or rank models do not agree; the message names the file or rank."""


def rank_file(rank: int) -> str:
    return f"rank{rank}.onnx"


def source_fingerprint(path: str | os.PathLike) -> str:
    """sha256 of the model file and of the names and sizes of its external data files (not their bytes:
    hashing a multi-GB model's data would cost more than sharding it)."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    for file in sorted(model_files.external_data_files(model_files.read_proto(path), Path(path).parent)):
        digest.update(f"{file.name}:{file.stat().st_size if file.exists() else -1}".encode())
    return digest.hexdigest()


def distributed_nodes(proto: onnx.ModelProto) -> list[dict]:
    """The model's nodes of DISTRIBUTED_OPS in graph order: name, op, attributes and the shapes of their
    constant inputs (None for a computed input)."""
    shapes = {t.name: list(t.dims) for t in proto.graph.initializer}
    records = []
    for node in proto.graph.node:
        if node.domain != DOMAIN or node.op_type not in DISTRIBUTED_OPS:
            continue
        attributes = {a.name: _plain(helper.get_attribute_value(a)) for a in node.attribute}
        records.append({"name": node.name, "op": node.op_type, "attributes": dict(sorted(attributes.items())),
                        "weights": [shapes.get(name) for name in node.input]})
    return records


def _plain(value):
    if isinstance(value, bytes):
        return value.decode()
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value if isinstance(value, (int, float, str)) else str(value)


def nodes_fingerprint(proto: onnx.ModelProto) -> str:
    """sha256 of :func:`distributed_nodes`: what a rank's model must hold for the shard to work together."""
    return hashlib.sha256(json.dumps(distributed_nodes(proto), sort_keys=True).encode()).hexdigest()


def rank_metadata(proto: onnx.ModelProto) -> dict | None:
    """The shard place ``moe-onnx shard`` wrote into a rank model, None for a model it did not write."""
    for prop in proto.metadata_props:
        if prop.key == METADATA_KEY:
            return json.loads(prop.value)
    return None


@dataclasses.dataclass
class Manifest:
    """shard.json: the source model, the world's shape and each rank's file and fingerprint."""

    source: str
    source_fingerprint: str
    tp: int
    ep: int
    files: list[str]
    fingerprints: list[str]
    format: int = MANIFEST_FORMAT

    @property
    def world(self) -> int:
        return self.tp * self.ep

    def document(self) -> dict:
        return {"format": self.format, "source": self.source, "source_fingerprint": self.source_fingerprint,
                "world": self.world, "tp": self.tp, "ep": self.ep,
                "ranks": [{"rank": g, "file": f, "fingerprint": p}
                          for g, (f, p) in enumerate(zip(self.files, self.fingerprints))]}

    def write(self, directory: str | os.PathLike) -> Path:
        path = Path(directory) / MANIFEST_NAME
        with model_files.replacing(path) as staged:
            staged.write_text(json.dumps(self.document(), indent=2) + "\n")
        return path

    @classmethod
    def read(cls, directory: str | os.PathLike) -> Manifest:
        """The manifest of a shard directory; ManifestError naming the file and what is wrong."""
        path = Path(directory) / MANIFEST_NAME
        if not path.exists():
            raise ManifestError(f"{path}: no such file; expected a directory written by `moe-onnx shard`")
        try:
            document = model_files.read_json(path)
            if document.integer("format") != MANIFEST_FORMAT:
                raise ManifestError(f"{path}: format {document.data['format']}; this moe-onnx reads format "
                                    f"{MANIFEST_FORMAT} (shard the model again)")
            ranks = sorted(document.objects("ranks"), key=lambda r: r.integer("rank"))
            manifest = cls(document.string("source"), document.string("source_fingerprint"), document.integer("tp"),
                           document.integer("ep"), [r.string("file") for r in ranks],
                           [r.string("fingerprint") for r in ranks])
            world = document.integer("world")
        except model_files.ModelFileError as error:
            raise ManifestError(str(error)) from None
        listed = [r.data["rank"] for r in ranks]
        if listed != list(range(manifest.world)) or world != manifest.world:
            raise ManifestError(f"{path}: lists ranks {listed} for world {world} = "
                                f"tp {manifest.tp} x ep {manifest.ep}; expected ranks 0..{manifest.world - 1}")
        return manifest


def rank_record(proto: onnx.ModelProto, rank: int) -> dict:
    """What a rank tells the others at session start: its shard place and the distributed nodes with the
    attributes every rank shares (the rank ids apart) and its weights' shapes."""
    nodes = distributed_nodes(proto)
    layouts = sorted({(n["attributes"].get("ep_rank_id", 0), n["attributes"].get("tp_rank_id", 0)) for n in nodes
                      if any(name in n["attributes"] for name in _RANK_ATTRS)})
    shared = [{**n, "attributes": {k: v for k, v in n["attributes"].items() if k not in _RANK_ATTRS}} for n in nodes]
    return {"rank": rank, "shard": rank_metadata(proto), "layouts": [list(layout) for layout in layouts],
            "nodes": shared}


def mismatches(records: list[dict], tp: int) -> list[str]:
    """What keeps the ranks' models (their :func:`rank_record`, one per rank, in rank order) from working
    together: a layout not of that rank, another shard, or distributed nodes that differ; each problem names
    the ranks. Weight shapes are compared within an EP group (the ranks of one TP rank), whose slices have
    the same shapes, and so are the slice widths in_features/out_features; the other attributes between all
    ranks."""
    problems = []
    first = records[0]
    for record in records:
        g = record["rank"]
        expected = [g // tp, g % tp]
        if record["layouts"] and record["layouts"] != [expected]:
            problems.append(f"rank {g}'s model holds the layout (ep_rank_id, tp_rank_id) = "
                            f"{', '.join(str(tuple(layout)) for layout in record['layouts'])}; rank {g} needs "
                            f"{tuple(expected)} (a file of another rank?)")
        if record is first:
            continue
        if _shard_place(record["shard"]) != _shard_place(first["shard"]):
            problems.append(f"ranks {first['rank']} and {g} hold models of different shards: "
                            f"{_shard_text(first['shard'])} vs {_shard_text(record['shard'])}")
            continue
        peer = records[g % tp]  # EP rank 0 of this rank's EP group
        for other, shapes in ((first, False), (peer, True)):
            difference = _node_difference(other["nodes"], record["nodes"], shapes) if other is not record else ""
            if difference:
                problems.append(f"ranks {other['rank']} and {g} hold different models: {difference}")
                break
    return problems


def _shard_place(shard: dict | None) -> dict | None:
    return None if shard is None else {k: v for k, v in shard.items() if k != "rank"}


def _shard_text(shard: dict | None) -> str:
    if shard is None:
        return "not written by moe-onnx shard"
    return f"source {shard['source_fingerprint'][:12]}, tp {shard['tp']}, ep {shard['ep']}, rank {shard['rank']}"


def _node_difference(a: list[dict], b: list[dict], shapes: bool) -> str:
    """How two ranks' distributed nodes differ ('' when they agree)."""
    if [(n["name"], n["op"]) for n in a] != [(n["name"], n["op"]) for n in b]:
        return (f"distributed nodes {[n['name'] or n['op'] for n in a]} vs {[n['name'] or n['op'] for n in b]}")
    for x, y in zip(a, b):
        attributes = [{k: v for k, v in n["attributes"].items() if shapes or k not in _SLICE_ATTRS} for n in (x, y)]
        if attributes[0] != attributes[1]:
            return f"node '{x['name']}' ({x['op']}) has attributes {attributes[0]} vs {attributes[1]}"
        if shapes and x["weights"] != y["weights"]:
            return f"node '{x['name']}' ({x['op']}) has input shapes {x['weights']} vs {y['weights']}"
    return ""
