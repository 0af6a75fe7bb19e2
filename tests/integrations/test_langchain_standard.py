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

# Overrides must restate the base tests' parametrization.
OUTPUT_VERSIONS = pytest.mark.parametrize("model", [{}, {"output_version": "v1"}], indirect=True)
SCHEMA_TYPES = pytest.mark.parametrize("schema_type", ["pydantic", "typeddict", "json_schema"])

# Output-quality limits of the 135M default model, not adapter bugs: the adapter paths these tests
# exercise are covered with prompts the model can follow in tests/integrations/test_langchain.py.
# Keep docs/langchain-standard-xfails.md in sync.
NO_TOOL_CALLS = pytest.mark.xfail(
    reason="SmolLM2-135M does not follow the tool-call instructions, so it emits no <tool_call> block",
    strict=False)
NO_STRUCTURED = pytest.mark.xfail(
    reason="structured output defaults to a forced tool call, which SmolLM2-135M does not emit",
    strict=False)
NO_JSON = pytest.mark.xfail(
    reason="SmolLM2-135M does not reliably answer with a JSON object of the requested keys", strict=False)


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

    # --- xfails: model quality (see NO_* above) ---------------------------------------------------
    @NO_TOOL_CALLS
    @OUTPUT_VERSIONS
    def test_tool_calling(self, model: Any) -> None:
        super().test_tool_calling(model)

    @NO_TOOL_CALLS
    async def test_tool_calling_async(self, model: Any) -> None:
        await super().test_tool_calling_async(model)

    @NO_TOOL_CALLS
    def test_bind_runnables_as_tools(self, model: Any) -> None:
        super().test_bind_runnables_as_tools(model)

    @NO_TOOL_CALLS
    def test_tool_choice(self, model: Any) -> None:
        super().test_tool_choice(model)

    @NO_TOOL_CALLS
    def test_tool_calling_with_no_arguments(self, model: Any) -> None:
        super().test_tool_calling_with_no_arguments(model)

    @NO_TOOL_CALLS
    @OUTPUT_VERSIONS
    def test_agent_loop(self, model: Any) -> None:
        super().test_agent_loop(model)

    @NO_TOOL_CALLS
    def test_unicode_tool_call_integration(self, model: Any, *, tool_choice: str | None = None,
                                           force_tool_call: bool = True) -> None:
        super().test_unicode_tool_call_integration(model, tool_choice=tool_choice, force_tool_call=force_tool_call)

    @NO_STRUCTURED
    @SCHEMA_TYPES
    def test_structured_output(self, model: Any, schema_type: str) -> None:
        super().test_structured_output(model, schema_type)

    @NO_STRUCTURED
    @SCHEMA_TYPES
    async def test_structured_output_async(self, model: Any, schema_type: str) -> None:
        await super().test_structured_output_async(model, schema_type)

    @NO_STRUCTURED
    def test_structured_output_pydantic_2_v1(self, model: Any) -> None:
        super().test_structured_output_pydantic_2_v1(model)

    @NO_STRUCTURED
    def test_structured_output_optional_param(self, model: Any) -> None:
        super().test_structured_output_optional_param(model)

    @NO_JSON
    def test_json_mode(self, model: Any) -> None:
        super().test_json_mode(model)
