"""The topology block: a named machine (:mod:`planc.plan.presets`), one that planc
calibrate measured and wrote to a file, or one the plan describes, against the mesh."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from planc.diagnostics import error
from planc.host.files import read_regular_file
from planc.host.json_values import too_long_integer
from planc.lang.blocks import BlockReader
from planc.vocabulary.hints import try_values as _try
from planc.plan.presets import GENERIC, PRESETS, WITHOUT_FP8, Preset, calibrated_preset
from planc.lang.schema import PresetFile
from planc.plan.plan import Mesh, Model
from planc.plan.topology import Device, Link, Topology

MAX_TOPOLOGY_BYTES = 1 << 20  # a calibrated topology is a few KB


@dataclass
class TopologyReader(BlockReader):
    """Reads topology { }: the machine the plan runs on, its files included."""

    def _topology(self, mesh: Mesh | None, model: Model | None) -> Topology | None:
        keys = ("topology.nodes", "topology.devices_per_node", "topology.preset")
        if mesh is None or any(k in self.given and self.value(k) is None for k in keys):
            return None
        given = self.value("topology.preset")
        if isinstance(given, PresetFile):
            preset = self._calibrated(given)
            if preset is None:
                return None
        else:
            preset = PRESETS.get(given) or GENERIC
        world = mesh.world
        nodes, per_node = self.value("topology.nodes"), self.value("topology.devices_per_node")
        if per_node is None and nodes is not None and preset.devices_per_node:
            per_node = preset.devices_per_node  # the preset's machine, unless overridden
        mesh_text = (f"tp {mesh.tp} x cp {mesh.cp} x pp {mesh.pp} x dp {mesh.dp} = "
                     f"{world} devices")
        if nodes is not None and per_node is not None:
            if nodes * per_node != world:
                hint = (_try("nodes", [world // per_node]) if world % per_node == 0 else
                        f"devices_per_node must divide the world size {world}")
                self.report(error(f"topology has {nodes} nodes x {per_node} devices = "
                                  f"{nodes * per_node} devices, but the mesh needs {mesh_text}",
                                  self.span("topology.nodes"), hint))
                return None
        elif nodes is not None:
            if world % nodes:
                self.report(error(f"the mesh's {mesh_text} do not split evenly over {nodes} "
                                  f"nodes", self.span("topology.nodes")))
                return None
            per_node = world // nodes
        else:
            if per_node is None:
                per_node = preset.devices_per_node or world
                where = self.span("topology.preset")
                if world % per_node:
                    self.report(error(f"the mesh's {mesh_text} do not fill whole {preset.name} "
                                      f"nodes of {per_node} devices", where,
                                      f"set devices_per_node = {world} to use part of a node"
                                      if world < per_node else ""))
                    return None
            elif world % per_node:
                self.report(error(f"the mesh's {mesh_text} do not fill whole nodes of "
                                  f"{per_node} devices", self.span("topology.devices_per_node")))
                return None
            nodes = world // per_node

        def pick(key: str, fallback: Any) -> Any:
            given = self.value(f"topology.{key}")
            return fallback if given is None else given

        if model is not None and model.options.get("fp8") is not None and \
                given in WITHOUT_FP8:
            self.report(error(f"fp8 multiplies on FP8 tensor cores, which the {preset.name} "
                              f"machine's GPUs do not have: {preset.description}",
                              self.span("topology.preset"),
                              _try("preset", [n for n, p in PRESETS.items()
                                              if "fp8" in p.flops])))
            return None
        dtype = model.dtype if model else "fp32"
        device = Device(pick("device.flops", preset.flops[dtype]),
                        pick("device.memory", preset.memory),
                        pick("device.efficiency", preset.efficiency),
                        pick("device.bandwidth", preset.memory_bandwidth),
                        pick("device.overlap", preset.overlap), preset.overhead,
                        preset.backward_overhead, preset.handoff, preset.overheads,
                        preset is not GENERIC or "topology.device.flops" in self.given,
                        preset.exp_rate)
        # A link given in the plan replaces the preset's, measured collectives and all.
        intra = Link(pick("intra.bandwidth", preset.intra_bandwidth),
                     pick("intra.latency", preset.intra_latency),
                     *(((), ()) if "topology.intra" in self.given else
                       (preset.intra_collectives, preset.intra_sweep)))
        inter = Link(pick("inter.bandwidth", preset.inter_bandwidth),
                     pick("inter.latency", preset.inter_latency),
                     () if "topology.inter" in self.given else preset.inter_collectives)
        return Topology(nodes, per_node, device, intra, inter, self.value("topology.preset"))

    def _calibrated(self, path: str) -> Preset | None:
        """The topology ``planc calibrate`` wrote at ``path`` (relative to the plan)."""
        base = os.path.dirname(os.path.abspath(self.path)) if self.path else os.getcwd()
        resolved = os.path.normpath(os.path.join(base, path))
        span = self.span("topology.preset")
        try:
            text = read_regular_file(resolved, MAX_TOPOLOGY_BYTES + 1)
        except OSError as exc:
            shown = "" if os.path.normpath(path) == resolved else f" ({resolved})"
            return self._reject(f"cannot read topology '{path}'{shown}: "
                                f"{exc.strerror or exc}", span,
                                "a topology's path is relative to the plan file")
        if len(text) > MAX_TOPOLOGY_BYTES:
            return self._reject(f"topology '{path}' is larger than "
                                f"{MAX_TOPOLOGY_BYTES // 1024} KB; it is not one planc "
                                f"calibrate wrote", span)
        try:
            data = json.loads(text)
        except (json.JSONDecodeError, UnicodeDecodeError):
            return self._unusable(path, "it is not JSON", span)
        except RecursionError:
            return self._unusable(path, "it nests its values too deep to be a planc "
                                        "topology", span)
        except ValueError:  # an integer of thousands of digits
            return self._unusable(path, f"it holds {too_long_integer()}", span)
        try:
            return calibrated_preset(data, path)
        except (ValueError, RecursionError, OverflowError) as exc:
            return self._unusable(path, str(exc), span)

    def _unusable(self, path: str, reason: str, span) -> None:
        return self._reject(f"cannot use topology '{path}': {reason}", span,
                            "write one with planc calibrate -o FILE")
