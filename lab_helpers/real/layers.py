"""A run's requests traced on a few layers and expanded to the model's depth.

Every decoder layer of most models is the same module with the same parameter shapes: each asks
the allocator for the same requests in every phase, and releases what the layer before (or the one
before it) left, its own key/value tensors of the step before, and its own temporaries. So a run is
traced on two models of the same config with fewer layers (TEMPLATE_LAYERS and one more), each
phase's events cut at the decoder layers' forward calls (forward pre-hooks marking positions in the
recorder, a forward hook after the last layer): the phase's head (embedding, positions, mask), one
region per layer, its tail (norm, head, argmax). One layer region of the smaller trace is repeated
to reach the model's depth, request ids renumbered: a release from a layer region names a request
of the same phase or an earlier one by its distance in layers (the layer before, the same layer one
step back), a release from a head or tail names its layer from the first layers or from the last.

Nothing of it is trusted unchecked:
- `uniform_layers` (the static guard): the family is one whose expansion was checked
  (tests/test_layer_expansion.py), the config's layer_types are all equal, and every decoder layer
  of the full model built on meta has the same submodules, of the same classes, with the same
  parameter and buffer shapes and the same plain attributes apart from the layer's index;
- the repeated layer and the layers it reaches back to (or forward to) hold the same events;
- the smaller trace expanded by one layer must equal the larger trace exactly (events, workspace
  ids, decode steps), and the expansion to the model's depth must release only requests made
  before, each once;
- a run that releases a load's request (a weight) is not expanded.
Where any of it fails, the run is traced whole (`expanded_run` answers None).
"""
import functools
from dataclasses import replace

from lab_helpers.core.forked import Forked
from lab_helpers.real.replay import RequestRecorder, RunTrace, trace_load, trace_run

# the transformers families whose runs were checked to expand (tests/test_layer_expansion.py: every
# family of data/models whose layers pass the guard, tensor parallel 1 and 2 where it is planned)
LAYER_EXPANDABLE_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "mixtral", "olmo2",
                             "gpt2", "gpt_neox", "phi3", "gemma2", "gemma3_text")
# layers of the smaller traced model (the larger has one more): the first layers of a decoder differ
# from the others (the first reads the embedding and makes the math libraries' workspaces, the second's
# input is still held by the model's forward, the third releases the first's output), and a layer
# releases what the layer two back made: six leave a repeated layer with the two after it equal to it
# (gpt2: layers 3, 4 and 5)
TEMPLATE_LAYERS = 6


class NotExpandable(Exception):
    """The run cannot be expanded exactly (internal: the caller traces it whole)."""


# ------------------------------------------------------------------ the static guard
def decoder_layers(model, count: int) -> "list | None":
    """The model's decoder layers: the one ModuleList of `count` modules of the class(es) transformers
    names as not to be split (_no_split_modules), else None."""
    import torch
    names = set(getattr(model, "_no_split_modules", None) or ())
    found = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m) == count
             and all(type(layer).__name__ in names for layer in m)]
    return list(found[0]) if len(found) == 1 else None


def _plain(value, paths: dict, depth: int = 0):
    """A comparable form of a module attribute: plain data by value, functions by their code and what
    they close over, the layer's own modules by their path in the layer (`paths`: id -> path), other
    objects by their class and attributes (three levels deep, then by identity)."""
    import types

    import torch
    if id(value) in paths:
        return ("module", paths[id(value)])
    if isinstance(value, (bool, int, float, str, type(None), torch.dtype, torch.device)):
        return (type(value).__name__, value)
    if isinstance(value, torch.Tensor):
        return _tensor(value)
    if depth > 3 or isinstance(value, (type, types.BuiltinFunctionType, torch.nn.Module)):
        return ("object", id(value))
    deeper = functools.partial(_plain, paths=paths, depth=depth + 1)
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(map(deeper, value)))
    if isinstance(value, dict):
        return ("dict", tuple(sorted((str(k), deeper(v)) for k, v in value.items())))
    if isinstance(value, functools.partial):
        return ("partial", deeper(value.func), deeper(value.args), deeper(value.keywords))
    if isinstance(value, types.MethodType):
        return ("method", value.__func__, deeper(value.__self__))
    if isinstance(value, types.FunctionType):  # a closure per module (tensor parallel's forward)
        return ("function", value.__code__, tuple(deeper(c.cell_contents) for c in value.__closure__ or ()))
    if hasattr(value, "__dict__"):
        return ("object", type(value), deeper(vars(value)))
    return ("object", id(value))


def _tensor(t) -> tuple:
    from torch.distributed.tensor import DTensor
    if isinstance(t, DTensor):
        return ("dtensor", tuple(t.shape), str(t.dtype), tuple(map(str, t.placements)), tuple(t.to_local().shape))
    return ("tensor", type(t).__name__, tuple(t.shape), str(t.dtype), t.device.type)


def _layer_facts(layer) -> tuple:
    """(structure, {attribute path: plain value}) of one decoder layer."""
    structure, attributes = [], {}
    paths = {id(module): name for name, module in layer.named_modules(remove_duplicate=False)}
    for name, module in layer.named_modules(remove_duplicate=False):
        structure.append((name, type(module)))
        structure.extend((name, "p", p, _tensor(t)) for p, t in module.named_parameters(recurse=False))
        structure.extend((name, "b", b, _tensor(t), b in module._non_persistent_buffers_set)
                         for b, t in module.named_buffers(recurse=False))
        for key, value in vars(module).items():
            if not key.startswith("_") and key != "training":
                attributes[(name, key)] = _plain(value, paths)
    return structure, attributes


def uniform_layers(shape, hf_config, model) -> bool:
    """Whether every decoder layer of `model` (the full model, built on meta) is the same: a family
    checked to expand (bitsandbytes' quantized weights too), the config's layer_types all equal, and
    each layer's submodules of the same classes with the same parameter and buffer shapes and plain
    attributes, apart from the layer's index (an attribute equal to it in every layer)."""
    if shape.model_type not in LAYER_EXPANDABLE_FAMILIES:
        return False
    count = getattr(hf_config, "num_hidden_layers", None)
    if not isinstance(count, int) or count < 1:
        return False
    types = getattr(hf_config, "layer_types", None)
    if types is not None and (len(types) != count or len(set(types)) > 1):
        return False
    layers = decoder_layers(model, count)
    if layers is None:
        return False
    facts = [_layer_facts(layer) for layer in layers]
    if any(f[0] != facts[0][0] or f[1].keys() != facts[0][1].keys() for f in facts):
        return False
    for key in facts[0][1]:
        values = [f[1][key] for f in facts]
        if all(v == values[0] for v in values):
            continue
        if all(v == ("int", i) for i, v in enumerate(values)):  # the layer's index
            continue
        return False
    return True


def plain_meta_model(hf_config):
    """The model of `hf_config` built on meta, untraced (for the guard where no model was built)."""
    import torch
    from transformers import AutoModelForCausalLM
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(hf_config, attn_implementation="sdpa")


# ------------------------------------------------------------------ fewer layers
def layer_count_keys(raw: dict, hf_config) -> list:
    """The keys of `raw` that give the number of layers (num_hidden_layers, or its name in the config
    class's attribute map: gpt2's n_layer)."""
    aliases = {"num_hidden_layers", getattr(type(hf_config), "attribute_map", {}).get("num_hidden_layers")}
    return [k for k in raw if k in aliases] or ["num_hidden_layers"]


def fewer_layers(shape, hf_config, layers: int):
    """`shape` with `layers` decoder layers (its layer_types cut to match); NotExpandable when another
    top-level list of the config holds one entry per layer (what it means is not known here)."""
    from lab_helpers.real.config import transformers_config_of
    full = hf_config.num_hidden_layers
    raw = dict(shape.raw)
    for key, value in raw.items():
        if key != "layer_types" and isinstance(value, list) and len(value) == full:
            raise NotExpandable(key)
    for key in layer_count_keys(raw, hf_config):
        raw[key] = layers
    if isinstance(raw.get("layer_types"), list):
        raw["layer_types"] = raw["layer_types"][:layers]
    if transformers_config_of(raw).num_hidden_layers != layers:
        raise NotExpandable("layers")
    return replace(shape, raw=raw, layers=layers, layer_windows=tuple(shape.layer_windows[:layers]))


class _CountingRecorder(RequestRecorder):
    """A RequestRecorder that counts its takes (two per phase: the releases before it, its own events)."""

    def __init__(self):
        super().__init__()
        self.takes = 0

    def take(self) -> list:
        self.takes += 1
        return super().take()


def trace_marked_run(shape, spec, model, load, mesh, decode_steps: int, layers: list,
                     layouts: "dict | None" = None) -> tuple:
    """(RunTrace, marks) of trace_run (`layouts`: its tracer's cache of output layouts), with
    marks[phase position] the positions in the phase's own events where each of `layers` starts and
    where the last one ends."""
    recorder = _CountingRecorder()
    marks = {}

    def mark(kind, index):
        marks.setdefault((recorder.takes - 1) // 2, []).append((kind, index, len(recorder.events)))

    handles = [layer.register_forward_pre_hook(lambda module, args, i=i: mark("start", i))
               for i, layer in enumerate(layers)]
    handles.append(layers[-1].register_forward_hook(lambda module, args, out: mark("end", len(layers) - 1)))
    try:
        trace = trace_run(shape, spec, model, load, mesh, decode_steps, recorder=recorder, layouts=layouts)
    finally:
        for handle in handles:
            handle.remove()
    return trace, marks


# ------------------------------------------------------------------ the template
class Split:
    """A traced run cut into regions: per phase (name, index, regions), regions in order 'pre', 'head',
    0 .. layers - 1, 'tail', each a list of events; `where[i]` the (phase, region, rank among the
    region's requests) of the run's i-th request."""

    def __init__(self, trace: RunTrace, marks: dict, layers: int, base: int):
        self.layers, self.base, self.decode_steps = layers, base, trace.decode_steps
        self.phases, self.where = [], []
        expected = [("start", i) for i in range(layers)] + [("end", layers - 1)]
        for p, (name, index, pre, own) in enumerate(trace.phases):
            found = marks.get(p, [])
            if found and [(k, i) for k, i, _ in found] != expected:
                raise NotExpandable("layer calls")  # a layer called twice, out of order, or not at all
            cuts = [0, *(at for _, _, at in found), len(own)] if found else [0, len(own)]
            if any(b < a for a, b in zip(cuts, cuts[1:])):
                raise NotExpandable("marks")
            keys = ["head", *range(layers), "tail"] if found else ["head"]
            regions = {"pre": pre, **{key: own[a:b] for key, a, b in zip(keys, cuts, cuts[1:])}}
            for key, events in regions.items():
                made = 0
                for event in events:
                    if event > 0:
                        self.where.append((p, key, made))
                        made += 1
            self.phases.append((name, index, regions))
        for _, _, pre, own in trace.phases:  # every release names a request of the run
            for event in (*pre, *own):
                if event < 0:
                    self.address(~event)
        self.persistent = [self.address(i) for i in trace.persistent]

    def address(self, request_id: int) -> tuple:
        local = request_id - self.base
        if local < 0:
            raise NotExpandable("a load request")  # a weight released or held by the run
        if local >= len(self.where):
            raise NotExpandable("unknown request")
        return self.where[local]

    def encoded(self, p: int, layer: int) -> tuple:
        """Layer `layer`'s events of phase `p`, releases named by (phase, layer distance, rank) or
        (phase, region, rank): what a copy of the layer would hold."""
        out = []
        for event in self.phases[p][2][layer]:
            if event > 0:
                out.append(event)
                continue
            q, key, rank = self.address(~event)
            out.append((q, "L", key - layer, rank) if isinstance(key, int) else (q, key, rank))
        return tuple(out)

    def reach(self) -> tuple:
        """(layers back, layers forward) that the layers' releases reach at most."""
        back = ahead = 0
        for p, (_, _, regions) in enumerate(self.phases):
            for layer in range(self.layers) if 0 in regions else ():
                for event in regions[layer]:
                    if event < 0:
                        key = self.address(~event)[1]
                        if isinstance(key, int):
                            back, ahead = max(back, layer - key), max(ahead, key - layer)
        return back, ahead

    def repeatable(self, m: int, back: int, ahead: int) -> bool:
        """Whether layers m - ahead .. m + back hold the same events in every phase: a copy of layer m
        then releases, `back` layers behind it (or `ahead` layers ahead), what the layers after it
        (or before it) release there."""
        if m - ahead < 0 or m + back >= self.layers:
            return False
        for p, (_, _, regions) in enumerate(self.phases):
            if 0 in regions:
                first = self.encoded(p, m)
                if any(self.encoded(p, j) != first for j in range(m - ahead, m + back + 1)):
                    return False
        return True

    def expand(self, m: int, layers: int, base: int) -> RunTrace:
        """The run with layer m repeated to `layers` layers, its requests numbered from `base`."""
        extra = layers - self.layers
        if extra < 0:
            raise NotExpandable("fewer layers")

        def source(j):
            return j if j < m else m if j <= m + extra else j - extra

        def outer(j):  # a layer named from a head, tail or workspace: the first ones, or from the last
            return j if j < m else j + extra

        # where each region's requests start in the expanded numbering, and how many it makes
        start, made, count = {}, {}, base
        for p, (_, _, regions) in enumerate(self.phases):
            keys = ["pre", "head", *range(layers), "tail"] if 0 in regions else ["pre", "head"]
            for key in keys:
                start[(p, key)] = count
                made[(p, key)] = sum(1 for e in regions[key if not isinstance(key, int) else source(key)] if e > 0)
                count += made[(p, key)]

        def new_id(q, key, rank):
            if (q, key) not in start or rank >= made[(q, key)]:
                raise NotExpandable("a layer out of range")
            return start[(q, key)] + rank

        phases = []
        for p, (name, index, regions) in enumerate(self.phases):
            parts = {}
            keys = ["pre", "head", *range(layers), "tail"] if 0 in regions else ["pre", "head"]
            for key in keys:
                layer = key if isinstance(key, int) else None
                events = regions[key if layer is None else source(key)]
                out = []
                for event in events:
                    if event > 0:
                        out.append(event)
                        continue
                    q, target, rank = self.address(~event)
                    if isinstance(target, int):
                        target = (key + target - source(key)) if layer is not None else outer(target)
                    out.append(~new_id(q, target, rank))
                parts[key] = out
            own = [e for key in keys[1:] for e in parts[key]]
            phases.append((name, index, parts["pre"], own))
        persistent = [new_id(q, outer(key) if isinstance(key, int) else key, rank)
                      for q, key, rank in self.persistent]
        return RunTrace(phases, persistent, self.decode_steps)


def well_formed(trace: RunTrace, base: int) -> bool:
    """Every release names a request of the run made before it, released once; the workspaces are
    requests of the run never released."""
    made, released = base, set()
    for _, _, pre, own in trace.phases:
        for event in (*pre, *own):
            if event > 0:
                made += 1
            elif not base <= ~event < made or ~event in released:
                return False
            else:
                released.add(~event)
    return all(base <= i < made and i not in released for i in trace.persistent)


# ------------------------------------------------------------------ the session's side
class LayerExpansion:
    """The two smaller models of one full model, dtype and rank, traced for each run to expand."""

    def __init__(self, shape, dtype: str, tensor_parallel: int, mesh, hf_config):
        self.shape, self.dtype, self.tensor_parallel, self.mesh = shape, dtype, tensor_parallel, mesh
        self.layers = hf_config.num_hidden_layers
        # both smaller models, at every size, run the same meta kernels on the same layouts again and
        # again (a decode step's projections do not depend on the context): their outputs' layouts
        # are kept once for all the runs traced here
        self.layouts = {}
        self.models = []
        for count in (TEMPLATE_LAYERS, TEMPLATE_LAYERS + 1):
            small = fewer_layers(shape, hf_config, count)
            load, model, _ = trace_load(small, dtype, tensor_parallel, mesh)
            found = decoder_layers(model, count)
            if found is None:
                raise NotExpandable("layers")
            self.models.append((small, load, model, found))

    @classmethod
    def prepare(cls, shape, dtype: str, tensor_parallel: int, mesh, model=None) -> "LayerExpansion | None":
        """The expansion of `shape`'s runs, or None where its layers do not pass the guard (`model`: the
        full model built on meta, else built here untraced) or have too few layers to gain anything."""
        from lab_helpers.real.protocol import transformers_config
        if shape.model_type not in LAYER_EXPANDABLE_FAMILIES:
            return None
        hf_config = transformers_config(shape)
        if hf_config.num_hidden_layers <= TEMPLATE_LAYERS + 1:
            return None
        if not uniform_layers(shape, hf_config, model if model is not None else plain_meta_model(hf_config)):
            return None
        try:
            return cls(shape, dtype, tensor_parallel, mesh, hf_config)
        except NotExpandable:
            return None

    def run(self, spec, load, decode_steps: int) -> "RunTrace | None":
        """The run of `spec` (its first `decode_steps` decode steps) for the full model whose load is
        `load`: expanded from the smaller models' traces, or None where any check fails."""
        def traced(which):
            small, small_load, model, layers = self.models[which]
            return trace_marked_run(small, spec, model, small_load, self.mesh, decode_steps, layers, self.layouts)

        # the two traces are independent: the larger one runs on a second core where there is one;
        # what a child adds to the layouts cache stays in it, and the smaller trace here adds the same
        # layouts (the two models run the same kernels), so the next probe's child starts with them
        with Forked(lambda: traced(1)) as larger:
            a, a_marks = traced(0)
            b, b_marks = larger.result()
        a_load, b_load = self.models[0][1], self.models[1][1]
        try:
            template = Split(a, a_marks, TEMPLATE_LAYERS, a_load.requests)
            Split(b, b_marks, TEMPLATE_LAYERS + 1, b_load.requests)  # the larger trace cuts the same way
            back, ahead = template.reach()
            for m in range(TEMPLATE_LAYERS):
                if not template.repeatable(m, back, ahead):
                    continue
                once = template.expand(m, TEMPLATE_LAYERS + 1, b_load.requests)
                if (once.phases, once.persistent, once.decode_steps) != (b.phases, b.persistent, b.decode_steps):
                    continue
                full = template.expand(m, self.layers, load.requests)
                return full if well_formed(full, load.requests) else None
        except NotExpandable:
            return None
        return None
