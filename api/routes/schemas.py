"""GET/POST /v1/schemas: the extraction schemas (built-in, and those the caller's tenant registered)."""
from __future__ import annotations

from fastapi import APIRouter, Depends, status

from pipeline.errors import UnknownSchemaError
from pipeline.schemas import get_schema, list_schemas, register_schema

from ..auth import Principal
from ..context import ApiContext, get_ctx, get_principal
from ..errors import NotFound
from ..views import SchemaIn, SchemaList, SchemaOut, schema_out
from . import Version

router = APIRouter(tags=["schemas"])


@router.get("/v1/schemas", response_model=SchemaList)
def schemas_list(ctx: ApiContext = Depends(get_ctx), who: Principal = Depends(get_principal)) -> SchemaList:
    with ctx.pipeline.db.read_session() as s:
        return SchemaList(items=[schema_out(row) for row in list_schemas(s, who.access)])


@router.get("/v1/schemas/{name}", response_model=SchemaOut)
def schemas_get(name: str, version: Version = None, ctx: ApiContext = Depends(get_ctx),
                who: Principal = Depends(get_principal)) -> SchemaOut:
    with ctx.pipeline.db.read_session() as s:
        try:
            return schema_out(get_schema(s, name, version, tenant=who.tenant))
        except UnknownSchemaError:
            raise NotFound("schema", name if version is None else f"{name} v{version}") from None


@router.post("/v1/schemas", response_model=SchemaOut, status_code=status.HTTP_201_CREATED)
def schemas_register(body: SchemaIn, ctx: ApiContext = Depends(get_ctx),
                     who: Principal = Depends(get_principal)) -> SchemaOut:
    """Register a schema of the caller's tenant (validated as JSON Schema and as a decoding grammar). Same content
    -> same version."""
    with ctx.pipeline.db.session() as s:
        row = register_schema(s, body.name, body.json_schema, prompt=body.prompt, merge_rules=body.merge_rules,
                              tenant=who.tenant)
        return schema_out(row)
