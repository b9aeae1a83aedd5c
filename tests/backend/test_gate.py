"""backend.gate: data calls run together, a control call runs alone and is not starved."""

from __future__ import annotations

import threading
import time

from kvxfer.backend.gate import Gate


def _enter_in_thread(side, inside: threading.Event, leave: threading.Event) -> threading.Thread:
    def run():
        with side:
            inside.set()
            leave.wait(10)
    t = threading.Thread(target=run)
    t.start()
    return t


def test_data_calls_overlap_and_control_waits_for_them():
    gate = Gate()
    a_in, b_in, c_in, leave = threading.Event(), threading.Event(), threading.Event(), threading.Event()
    a = _enter_in_thread(gate.data, a_in, leave)
    b = _enter_in_thread(gate.data, b_in, leave)
    assert a_in.wait(5) and b_in.wait(5)  # two data calls inside at once
    c = _enter_in_thread(gate.control, c_in, leave)
    assert not c_in.wait(0.2)  # the control call waits while data calls are inside
    leave.set()
    assert c_in.wait(5)
    for t in (a, b, c):
        t.join(10)


def test_a_waiting_control_call_goes_before_new_data_calls():
    gate = Gate()
    a_in, leave_a = threading.Event(), threading.Event()
    a = _enter_in_thread(gate.data, a_in, leave_a)
    assert a_in.wait(5)
    order = []
    c_in = threading.Event()

    def control():
        with gate.control:
            order.append("control")
            c_in.set()

    def data():
        with gate.data:
            order.append("data")

    c = threading.Thread(target=control)
    c.start()
    deadline = time.monotonic() + 5
    while not gate._asking and time.monotonic() < deadline:  # the control call is waiting
        time.sleep(0.001)
    d = threading.Thread(target=data)
    d.start()
    time.sleep(0.1)
    assert order == []  # the new data call queues behind the waiting control call
    leave_a.set()
    for t in (a, c, d):
        t.join(10)
    assert order == ["control", "data"]


def test_without_shared_mode_data_calls_run_one_at_a_time():
    gate = Gate(shared=False)
    a_in, b_in, leave = threading.Event(), threading.Event(), threading.Event()
    a = _enter_in_thread(gate.data, a_in, leave)
    assert a_in.wait(5)
    b = _enter_in_thread(gate.data, b_in, leave)
    assert not b_in.wait(0.2)
    leave.set()
    assert b_in.wait(5)
    a.join(10)
    b.join(10)
