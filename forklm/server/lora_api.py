"""Loading and unloading LoRA adapters at run time: SGLang's /load_lora_adapter and
/unload_lora_adapter (vLLM's /v1/ twins). The server must be started with --enable-lora: an
endpoint that reads folders named by a client is off unless the operator turns it on."""

from __future__ import annotations

import asyncio
from typing import Annotated, Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field

from forklm.runtime.errors import InvalidArgumentError
from forklm.server.native_api import service_of
from forklm.server.protocol import AdapterName

router = APIRouter()


class LoadLoraRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: AdapterName
    lora_path: Annotated[str, Field(min_length=1, max_length=4096)]
    pinned: bool = False  # SGLang's; every loaded adapter stays registered here until unloaded


class UnloadLoraRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: AdapterName


@router.post("/load_lora_adapter")
@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(body: LoadLoraRequest, request: Request) -> dict[str, Any]:
    engine = _runtime_lora_engine(request)
    # reading and converting the adapter's tensors is file and tensor work: off the event loop
    await asyncio.to_thread(engine.load_lora_adapter, body.lora_name, body.lora_path)
    return {"success": True, "error_message": "", "loaded_adapters": engine.lora_adapters()}


@router.post("/unload_lora_adapter")
@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(body: UnloadLoraRequest, request: Request) -> dict[str, Any]:
    engine = _runtime_lora_engine(request)
    engine.unload_lora_adapter(body.lora_name)
    return {"success": True, "error_message": "", "loaded_adapters": engine.lora_adapters()}


def _runtime_lora_engine(request: Request) -> Any:
    engine = service_of(request).engine
    if engine.config.enable_lora is not True:
        raise InvalidArgumentError("enable_lora", engine.config.enable_lora,
                                   "loading adapters over HTTP is off; start the server with "
                                   "--enable-lora to allow it")
    return engine
