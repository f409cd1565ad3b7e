"""Runtime.set_tracing / drain_trace over the engine's task observers: a TraceRecorder attached while tracing."""

import numpy as np

import engine
from engine import In, Out
from engine import kernels as K


@engine.program
def double(run, x: In((4,)), y: Out((4,))):
    run.submit(K.add, x, x, out=y)


def run_ids(events) -> set[int]:
    return {e[0] for e in events}


def test_tracing_off_then_on_again_records_only_while_on_and_keeps_events_until_drained(prepared):
    rt = prepared(double)
    x = np.ones(4, np.float32)
    rt.set_tracing(True)
    rt.set_tracing(True)  # twice: still one recorder, each task once
    first = rt.submit(x)
    first.result()
    rt.set_tracing(False)
    rt(x)  # not traced
    spans, events = rt.drain_trace()  # what was recorded while on stays until drained
    assert spans == []  # host spans go when tracing stops, as before
    assert run_ids(events) == {first.id}
    assert sorted(e[5] for e in events) == ["add", "copy_back"]
    assert all(len(e) == 7 and e[6] is True for e in events)
    rt.set_tracing(True)
    again = rt.submit(x)
    again.result()
    spans, events = rt.drain_trace()
    assert run_ids(events) == {again.id}
    assert {s[0] for s in spans} == {again.id}
    assert rt.drain_trace() == ([], [])


def test_drain_trace_without_tracing_is_empty(prepared):
    rt = prepared(double)
    rt(np.ones(4, np.float32))
    assert rt.drain_trace() == ([], [])


def test_close_detaches_the_recorder(prepared):
    rt = prepared(double)
    rt.set_tracing(True)
    rt(np.ones(4, np.float32))
    native, recorder = rt._engine, rt._trace
    rt.close()
    assert not native.remove_observer(recorder)  # detached by close
