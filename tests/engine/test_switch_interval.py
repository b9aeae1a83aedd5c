"""``AgentConfig.switch_interval`` sets the interpreter's switch interval when the agent is made."""

import sys

from agent_helpers import spec


def test_an_agent_sets_the_switch_interval_it_is_given_and_none_leaves_it(harness):
    before = sys.getswitchinterval()
    try:
        harness.agent(spec())
        assert sys.getswitchinterval() == before
        harness.agent(spec(), switch_interval=0.0007)
        assert sys.getswitchinterval() == 0.0007
    finally:
        sys.setswitchinterval(before)
