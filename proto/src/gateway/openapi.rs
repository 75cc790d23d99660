//! The OpenAPI 3.1 document of the HTTP/JSON gateway, made from the
//! services' descriptors (their messages, fields and comments) and the
//! resource paths: what the gateway takes and answers, as it does (field
//! names as in the `.proto`, 64-bit integers as numbers, `bytes` as
//! base64, enums by name, no field that is not described).

use std::collections::BTreeMap;

use prost_reflect::{
    DescriptorPool, EnumDescriptor, FieldDescriptor, Kind, MessageDescriptor, MethodDescriptor,
};
use serde_json::{Value, json};

use super::{Body_, Route};

/// The comment written before the element at `path` of `file`'s source.
fn comment(file: &prost_reflect::FileDescriptor, path: &[i32]) -> Option<String> {
    let info = file.file_descriptor_proto().source_code_info.as_ref()?;
    let loc = info.location.iter().find(|l| l.path == path)?;
    let text = loc.leading_comments.as_deref()?.trim();
    (!text.is_empty()).then(|| text.lines().map(str::trim).collect::<Vec<_>>().join("\n"))
}

fn schema_ref(full_name: &str) -> Value {
    json!({ "$ref": format!("#/components/schemas/{full_name}") })
}

/// The schema of one value of `kind` (messages and enums by reference,
/// collected into `todo`).
fn kind_schema(kind: &Kind, todo: &mut Vec<Named>) -> Value {
    match kind {
        Kind::Double | Kind::Float => json!({ "type": "number" }),
        Kind::Int32 | Kind::Sint32 | Kind::Sfixed32 => {
            json!({ "type": "integer", "format": "int32" })
        }
        Kind::Uint32 | Kind::Fixed32 => {
            json!({ "type": "integer", "format": "int64", "minimum": 0 })
        }
        Kind::Int64 | Kind::Sint64 | Kind::Sfixed64 => {
            json!({ "type": "integer", "format": "int64" })
        }
        Kind::Uint64 | Kind::Fixed64 => json!({ "type": "integer", "minimum": 0 }),
        Kind::Bool => json!({ "type": "boolean" }),
        Kind::String => json!({ "type": "string" }),
        Kind::Bytes => json!({ "type": "string", "contentEncoding": "base64" }),
        Kind::Message(m) => {
            todo.push(Named::Message(m.clone()));
            schema_ref(m.full_name())
        }
        Kind::Enum(e) => {
            todo.push(Named::Enum(e.clone()));
            schema_ref(e.full_name())
        }
    }
}

fn field_schema(f: &FieldDescriptor, todo: &mut Vec<Named>) -> Value {
    let mut s = if f.is_map() {
        let Kind::Message(entry) = f.kind() else {
            return json!({});
        };
        let value = entry.map_entry_value_field();
        json!({
            "type": "object",
            "additionalProperties": kind_schema(&value.kind(), todo),
        })
    } else if f.is_list() {
        json!({ "type": "array", "items": kind_schema(&f.kind(), todo) })
    } else {
        kind_schema(&f.kind(), todo)
    };
    if let Some(c) = comment(&f.parent_file(), f.path()) {
        // Beside a `$ref`, 3.1 keeps sibling keywords.
        s["description"] = c.into();
    }
    s
}

enum Named {
    Message(MessageDescriptor),
    Enum(EnumDescriptor),
}

fn message_schema(m: &MessageDescriptor, todo: &mut Vec<Named>) -> Value {
    let mut props = serde_json::Map::new();
    for f in m.fields() {
        props.insert(f.name().to_string(), field_schema(&f, todo));
    }
    let mut s = json!({
        "type": "object",
        "properties": props,
        "additionalProperties": false,
    });
    let oneofs: Vec<String> = m
        .oneofs()
        .filter(|o| !o.is_synthetic())
        .map(|o| {
            let names: Vec<String> = o.fields().map(|f| f.name().to_string()).collect();
            format!("at most one of {}", names.join(", "))
        })
        .collect();
    let mut text = comment(&m.parent_file(), m.path()).unwrap_or_default();
    if !oneofs.is_empty() {
        if !text.is_empty() {
            text.push_str("\n\n");
        }
        text.push_str(&oneofs.join("; "));
    }
    if !text.is_empty() {
        s["description"] = text.into();
    }
    s
}

fn enum_schema(e: &EnumDescriptor) -> Value {
    let names: Vec<String> = e.values().map(|v| v.name().to_string()).collect();
    let mut s = json!({ "type": "string", "enum": names });
    if let Some(c) = comment(&e.parent_file(), e.path()) {
        s["description"] = c.into();
    }
    s
}

fn error_schema() -> Value {
    json!({
        "type": "object",
        "required": ["error"],
        "additionalProperties": false,
        "properties": {
            "error": {
                "type": "object",
                "required": ["code", "message"],
                "additionalProperties": false,
                "properties": {
                    "code": { "type": "string", "description": "The gRPC status code's name (NOT_FOUND, ...)." },
                    "reason": { "type": "string", "description": "Why, in words a program may match on (the corral-reason of the gRPC call: sandbox_not_found, policy_denied, ...)." },
                    "message": { "type": "string", "description": "For people; may change." },
                    "flag": { "type": "string", "description": "A refusal by policy: the worker flag that would allow what was asked." }
                }
            }
        }
    })
}

fn errors() -> Value {
    json!({
        "description": "An error: its HTTP status is its gRPC code's (400 INVALID_ARGUMENT and FAILED_PRECONDITION, 401, 403, 404, 409, 429 RESOURCE_EXHAUSTED, 503 UNAVAILABLE, ...).",
        "content": { "application/json": { "schema": schema_ref("corral.Error") } }
    })
}

/// What a method answers with.
fn answer(m: &MethodDescriptor) -> Value {
    let out = schema_ref(m.output().full_name());
    if m.is_server_streaming() {
        json!({
            "description": "A stream: one message a line (application/x-ndjson), or one an event with `Accept: text/event-stream`; an error after the first message is a last line (event `error`) of the error's JSON.",
            "content": {
                "application/x-ndjson": { "schema": out },
                "text/event-stream": { "schema": { "type": "string" } }
            }
        })
    } else {
        json!({
            "description": "The answer.",
            "content": { "application/json": { "schema": out } }
        })
    }
}

fn request_body(m: &MethodDescriptor, required: bool) -> Value {
    let input = schema_ref(m.input().full_name());
    if m.is_client_streaming() {
        json!({
            "required": true,
            "description": "A stream of requests: one JSON message a line (newline-delimited JSON).",
            "content": { "application/x-ndjson": { "schema": input } }
        })
    } else {
        json!({
            "required": required,
            "content": { "application/json": { "schema": input } }
        })
    }
}

fn operation(m: &MethodDescriptor, summary: Option<&str>) -> Value {
    let mut op = json!({
        "operationId": format!("{}.{}", m.parent_service().name(), m.name()),
        "tags": [m.parent_service().full_name()],
        "responses": { "200": answer(m), "default": errors() },
    });
    if let Some(s) = summary {
        op["summary"] = s.into();
    }
    if let Some(c) = comment(&m.parent_file(), m.path()) {
        op["description"] = c.into();
    }
    op
}

/// The type of request field `path` (`a.b`), as a parameter's schema.
fn param_schema(input: &MessageDescriptor, path: &str, todo: &mut Vec<Named>) -> Value {
    let mut desc = input.clone();
    let mut parts = path.split('.').peekable();
    while let Some(p) = parts.next() {
        let Some(f) = desc.get_field_by_name(p) else {
            return json!({ "type": "string" });
        };
        if parts.peek().is_none() {
            return field_schema(&f, todo);
        }
        match f.kind() {
            Kind::Message(m) => desc = m,
            _ => return json!({ "type": "string" }),
        }
    }
    json!({ "type": "string" })
}

/// The document for `services` of `pool` and their resource paths.
pub fn document(pool: &DescriptorPool, services: &[&str], routes: &[Route]) -> Value {
    let mut todo: Vec<Named> = Vec::new();
    let mut paths: BTreeMap<String, serde_json::Map<String, Value>> = BTreeMap::new();
    let mut tags = Vec::new();
    for name in services {
        let Some(service) = pool.get_service_by_name(name) else {
            continue;
        };
        let mut tag = json!({ "name": service.full_name() });
        if let Some(c) = comment(&service.parent_file(), service.path()) {
            tag["description"] = c.into();
        }
        tags.push(tag);
        for m in service.methods() {
            todo.push(Named::Message(m.input()));
            todo.push(Named::Message(m.output()));
            let mut op = operation(&m, None);
            op["requestBody"] = request_body(&m, false);
            paths
                .entry(format!("/v1/{}/{}", service.full_name(), m.name()))
                .or_default()
                .insert("post".into(), op);
        }
    }
    for r in routes {
        let Some((svc, method)) = r.rpc.split_once('/') else {
            continue;
        };
        let Some(m) = pool
            .get_service_by_name(svc)
            .and_then(|s| s.methods().find(|m| m.name() == method))
        else {
            continue;
        };
        let input = m.input();
        let mut op = operation(&m, Some(r.summary));
        op["operationId"] = format!(
            "{}.{}.{}",
            r.method.as_str().to_lowercase(),
            m.parent_service().name(),
            m.name()
        )
        .into();
        let in_path: Vec<&str> = r
            .path
            .split('/')
            .filter_map(|seg| seg.strip_prefix('{').and_then(|s| s.strip_suffix('}')))
            .collect();
        let mut params: Vec<Value> = in_path
            .iter()
            .map(|p| {
                json!({
                    "name": p, "in": "path", "required": true,
                    "schema": param_schema(&input, p, &mut todo),
                })
            })
            .collect();
        match r.body {
            Body_::Json => {
                // Scalar fields may come in the query (GET has no body).
                for f in input.fields() {
                    let scalar = !f.is_list()
                        && !f.is_map()
                        && !matches!(f.kind(), Kind::Message(_) | Kind::Bytes);
                    if scalar && !in_path.contains(&f.name()) {
                        params.push(json!({
                            "name": f.name(), "in": "query", "required": false,
                            "schema": field_schema(&f, &mut todo),
                        }));
                    }
                }
                if r.method != http::Method::GET && r.method != http::Method::DELETE {
                    op["requestBody"] = request_body(&m, false);
                }
            }
            Body_::TarOut => {
                params.push(json!({
                    "name": "operation_id", "in": "query", "required": false,
                    "schema": param_schema(&input, "operation_id", &mut todo),
                }));
                for (from, to) in r.rename {
                    params.push(json!({
                        "name": from, "in": "query", "required": *from == "path",
                        "schema": param_schema(&input, to, &mut todo),
                    }));
                }
                op["responses"]["200"] = json!({
                    "description": "The archive (a failure after its first bytes breaks the answer off).",
                    "content": { "application/x-tar": { "schema": { "type": "string", "contentMediaType": "application/x-tar" } } }
                });
            }
            Body_::TarIn => {
                for f in ["path", "operation_id"] {
                    if input.get_field_by_name(f).is_some() {
                        params.push(json!({
                            "name": f, "in": "query", "required": f == "path",
                            "schema": param_schema(&input, f, &mut todo),
                        }));
                    }
                }
                op["requestBody"] = json!({
                    "required": true,
                    "content": { "application/x-tar": { "schema": { "type": "string", "contentMediaType": "application/x-tar" } } }
                });
            }
        }
        if !params.is_empty() {
            op["parameters"] = params.into();
        }
        paths
            .entry(r.path.to_string())
            .or_default()
            .insert(r.method.as_str().to_lowercase(), op);
    }
    let mut schemas = serde_json::Map::new();
    schemas.insert("corral.Error".into(), error_schema());
    while let Some(n) = todo.pop() {
        match n {
            Named::Message(m) => {
                if !schemas.contains_key(m.full_name()) {
                    // Placed first: a message that names itself stops here.
                    schemas.insert(m.full_name().to_string(), Value::Null);
                    let s = message_schema(&m, &mut todo);
                    schemas.insert(m.full_name().to_string(), s);
                }
            }
            Named::Enum(e) => {
                if !schemas.contains_key(e.full_name()) {
                    schemas.insert(e.full_name().to_string(), enum_schema(&e));
                }
            }
        }
    }
    json!({
        "openapi": "3.1.0",
        "info": {
            "title": "Corral",
            "version": env!("CARGO_PKG_VERSION"),
            "description": "Corral's gRPC services as HTTP/JSON (see docs/http-api.md): each method is POST /v1/<service>/<Method>; the main ones have resource paths too.",
        },
        "tags": tags,
        "security": [{ "bearer": [] }],
        "paths": paths,
        "components": {
            "schemas": schemas,
            "securitySchemes": {
                "bearer": {
                    "type": "http",
                    "scheme": "bearer",
                    "description": "The worker's token, or a front door's key.",
                }
            }
        }
    })
}
