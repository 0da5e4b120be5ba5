"""The traces of one model, dtype and rank, made once and kept (lab_helpers.real.trace_cache): the
load, and each (batch, context)'s phases; the meta model is built only when a trace is missing.

Where the run's decode steps repeat (lab_helpers.real.replay.decode_steps_to_trace), a run of N new
tokens is traced for TRACED_DECODE_STEPS steps (more where a sliding window starts cropping mid-run)
and extended (expand_decode); where the traced steps do not repeat, all N steps are traced.

Where every decoder layer is the same (lab_helpers.real.layers), a run is traced on two models of the
same config with a few layers and expanded to the model's depth, checked exactly; else it is traced on
the full model."""
from lab_helpers.real.replay import (decode_steps_to_trace, decode_workspace_affine, default_allocator, expand_decode,
                                     replay_rank, trace_load, trace_run)
from lab_helpers.real.trace_cache import TraceCache, base_key


class ModelNeeded(Exception):
    """A trace is missing and a tensor-parallel rank's model needs its process group (internal)."""


class TraceSession:
    """Traces of one model, dtype, degree and rank."""

    def __init__(self, shape, dtype: str, tensor_parallel: int = 1, rank: int = 0, cache: "TraceCache | None" = None,
                 expand: bool = True, expand_layers: "bool | None" = None):
        self.shape, self.dtype, self.tensor_parallel, self.rank = shape, dtype, tensor_parallel, rank
        self.cache = cache if cache is not None else TraceCache(None)
        self.expand = expand
        # runs expanded from a few traced layers (lab_helpers.real.layers); by default as `expand`
        self.expand_layers = expand if expand_layers is None else expand_layers
        self._layers = None  # the LayerExpansion, False where the model's layers refuse it
        self.key = base_key(shape, dtype, tensor_parallel, rank)
        self.model = self.mesh = self._load = None
        self.traced = []  # (batch, context, decode steps) of the runs traced here, not found in the cache
        self.layer_expanded = []  # those of them expanded from a few traced layers

    def _build(self, mesh) -> None:
        if self.tensor_parallel > 1 and mesh is None:
            raise ModelNeeded
        self._load, self.model, _ = trace_load(self.shape, self.dtype, self.tensor_parallel, mesh)
        self.mesh = mesh
        self.cache.put({**self.key, "kind": "load"}, self._load)

    def load(self, mesh=None):
        """The LoadTrace of the rank's model_load."""
        if self._load is None:
            self._load = self.cache.get({**self.key, "kind": "load"})
            if self._load is None:
                self._build(mesh)
        return self._load

    def _run(self, batch: int, context: int, steps: int, mesh):
        key = {**self.key, "kind": "run", "batch": batch, "context": context, "decode_steps": steps}
        found = self.cache.get(key)
        if found is not None:
            return found
        from lab_helpers.real.spec import RunSpec
        spec = RunSpec(self.shape.name, dtype=self.dtype, batch=batch, context=context, new_tokens=steps,
                       tensor_parallel=self.tensor_parallel)
        trace = self._layered_run(spec, steps, mesh) if self.expand_layers else None
        if trace is None:
            if self.model is None:
                self._build(mesh)
            trace = trace_run(self.shape, spec, self.model, self._load, self.mesh, steps)
        else:
            self.layer_expanded.append((batch, context, steps))
        self.traced.append((batch, context, steps))
        self.cache.put(key, trace)
        return trace

    def _layered_run(self, spec, steps: int, mesh):
        """The run expanded from a few traced layers (lab_helpers.real.layers), or None where the model
        or the run refuses it."""
        from lab_helpers.real.layers import LayerExpansion
        if self._layers is None:
            if self.tensor_parallel > 1 and mesh is None:
                raise ModelNeeded
            def prepare():
                return LayerExpansion.prepare(self.shape, self.dtype, self.tensor_parallel, mesh, self.model) or False
            self._layers = self.cache.expansion(self.key, prepare) if self.tensor_parallel == 1 else prepare()
        if self._layers is False:
            return None
        return self._layers.run(spec, self._load, steps)

    def run(self, batch: int, context: int, new_tokens: int, mesh=None):
        """The RunTrace of `new_tokens` decode steps at (batch, context): extended from traced steps where
        they repeat, else traced whole."""
        self.load(mesh)
        steps = decode_steps_to_trace(self.shape, context, new_tokens)
        if (self.expand and steps is not None and new_tokens > steps
                and decode_workspace_affine(self.shape, batch, self.tensor_parallel, context, new_tokens)):
            expanded = expand_decode(self._run(batch, context, steps, mesh), new_tokens)
            if expanded is not None:
                return expanded
        return self._run(batch, context, new_tokens, mesh)

    def replay(self, spec, capacity_bytes, recorded_steps, mesh=None, make_allocator=default_allocator,
               phase_budget=None, report: bool = False) -> dict:
        """replay_rank over the rank's load and the run of `spec`."""
        run = self.run(spec.batch, spec.context, spec.new_tokens, mesh)
        return replay_rank(self._load, run, capacity_bytes, recorded_steps, make_allocator, phase_budget, report)

    def replay_load(self, capacity_bytes, mesh=None, make_allocator=default_allocator) -> dict:
        """replay_rank over the rank's load alone (OutOfMemory when it does not fit `capacity_bytes`)."""
        return replay_rank(self.load(mesh), None, capacity_bytes, (), make_allocator)
