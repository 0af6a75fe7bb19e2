"""langchain-tests standard suites for ChatKVCMAS on the real default model (CPU)."""
from __future__ import annotations

from typing import Any

import pytest
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage
from langchain_tests.integration_tests import ChatModelIntegrationTests
from langchain_tests.unit_tests import ChatModelUnitTests

from kvcmas_agents.integrations.langchain import ChatKVCMAS

# The suites pass remote-client settings (timeout, max_retries, api_key), which ChatKVCMAS warns it ignores.
pytestmark = pytest.mark.filterwarnings("ignore:ChatKVCMAS runs the model in this process")

# Small enough to keep the suite fast on 2 CPU cores, large enough for one short tool call.
PARAMS: dict[str, Any] = {"max_tokens": 32, "agent": "standard-tests"}

# Output-quality limits of the 135M default model, not adapter bugs or missing features: tool calls
# and structured output are grammar-constrained (docs/structured_output.md), so what is left is what
# the model writes inside them. Keep docs/langchain-standard-xfails.md in sync.
CUT_BY_LENGTH = pytest.mark.xfail(
    reason="the constrained reply is well-formed, but SmolLM2-135M keeps writing inside a free-text string "
           "past the suite's 32-token budget, so the JSON/call is cut (finish_reason='length')", strict=False)

# typeddict and json_schema pass: LangChain's dict parser closes the cut JSON and the test only checks
# that no unknown key appears. The pydantic class needs "punchline", which the cut JSON lacks.
SCHEMA_TYPES = pytest.mark.parametrize("schema_type", [pytest.param("pydantic", marks=CUT_BY_LENGTH),
                                                       "typeddict", "json_schema"])
# langchain-tests requires an override to carry an xfail reason; this one holds for no case by itself
# (condition False): the pydantic case's own CUT_BY_LENGTH mark is the expected failure.
ONLY_PYDANTIC_CUT = pytest.mark.xfail(False, reason="overridden only to xfail the pydantic case (CUT_BY_LENGTH)")


class TestChatKVCMASUnit(ChatModelUnitTests):
    @property
    def chat_model_class(self) -> type[ChatKVCMAS]:
        return ChatKVCMAS

    @property
    def chat_model_params(self) -> dict[str, Any]:
        return {"agent": "standard-tests"}

    @pytest.mark.xfail(
        reason="the test loads with allowed_objects='all', which langchain-core 1.8 limits to classes in its "
               "own mapping; test_langchain.py::test_dumpd_and_loads_round_trip allows ChatKVCMAS by name",
        strict=True, raises=ValueError)
    def test_serdes(self, model: Any, snapshot: Any) -> None:
        super().test_serdes(model, snapshot)


class TestChatKVCMASIntegration(ChatModelIntegrationTests):
    @property
    def chat_model_class(self) -> type[ChatKVCMAS]:
        return ChatKVCMAS

    @property
    def chat_model_params(self) -> dict[str, Any]:
        return PARAMS

    @property
    def has_tool_choice(self) -> bool:
        return True

    @property
    def supports_json_mode(self) -> bool:
        return True

    @property
    def returns_usage_metadata(self) -> bool:
        return True

    @property
    def supports_image_inputs(self) -> bool:
        return False

    @property
    def supported_usage_metadata_details(self) -> dict[str, list[str]]:
        return {"invoke": ["cache_read_input"], "stream": ["cache_read_input"]}

    def invoke_with_cache_read_input(self, *, stream: bool = False) -> AIMessage:
        llm = ChatKVCMAS(**PARAMS)
        messages = [SystemMessage("You are a helpful assistant. " * 8), HumanMessage("Say hi.")]
        llm.invoke(messages)    # warms the prefix cache for the second call
        if stream:
            full = None
            for chunk in llm.stream(messages):
                full = chunk if full is None else full + chunk
            return full
        return llm.invoke(messages)

    # --- restated parametrizations: only the pydantic case is expected to fail ----------------------
    @ONLY_PYDANTIC_CUT
    @SCHEMA_TYPES
    def test_structured_output(self, model: Any, schema_type: str) -> None:
        super().test_structured_output(model, schema_type)

    @ONLY_PYDANTIC_CUT
    @SCHEMA_TYPES
    async def test_structured_output_async(self, model: Any, schema_type: str) -> None:
        await super().test_structured_output_async(model, schema_type)

    # --- xfails: model quality (see above) --------------------------------------------------------
    @CUT_BY_LENGTH
    def test_bind_runnables_as_tools(self, model: Any) -> None:
        super().test_bind_runnables_as_tools(model)

    @CUT_BY_LENGTH
    def test_unicode_tool_call_integration(self, model: Any, *, tool_choice: str | None = None,
                                           force_tool_call: bool = True) -> None:
        super().test_unicode_tool_call_integration(model, tool_choice=tool_choice, force_tool_call=force_tool_call)

    @CUT_BY_LENGTH
    def test_structured_output_pydantic_2_v1(self, model: Any) -> None:
        super().test_structured_output_pydantic_2_v1(model)

    @CUT_BY_LENGTH
    def test_json_mode(self, model: Any) -> None:
        super().test_json_mode(model)
