use super::*;

fn pool() -> DescriptorPool {
    DescriptorPool::decode(crate::pb::FILE_DESCRIPTOR_SET).expect("the descriptors")
}

#[test]
fn query_text_is_decoded() {
    assert_eq!(
        query_pairs("path=%2Fworkspace%2Fa+b&x=1&&y").expect("decoded"),
        vec![
            ("path".into(), "/workspace/a b".into()),
            ("x".into(), "1".into()),
            ("y".into(), String::new()),
        ]
    );
    // A stray or cut escape is kept as it is; what is not UTF-8 refused.
    assert_eq!(percent_decode("100%").expect("kept"), "100%");
    assert_eq!(percent_decode("%zz%4").expect("kept"), "%zz%4");
    let e = percent_decode("%ff").expect_err("not UTF-8");
    assert_eq!(e.code(), Code::InvalidArgument);
}

#[test]
fn path_and_query_fields_fill_the_request_by_kind() {
    let pool = pool();
    let desc = pool
        .get_message_by_name("corral.v1.DownloadRequest")
        .expect("DownloadRequest");
    let mut msg = DynamicMessage::new(desc);
    set_field(&mut msg, "sandbox_id", "sb-1").expect("a string");
    set_field(&mut msg, "archive.path", "/workspace").expect("a nested string");
    let typed: crate::pb::DownloadRequest = msg.transcode_to().expect("a DownloadRequest");
    assert_eq!(typed.sandbox_id, "sb-1");
    assert_eq!(typed.archive.expect("archive").path, "/workspace");

    let desc = pool
        .get_message_by_name("corral.v1.WatchSandboxRequest")
        .expect("WatchSandboxRequest");
    let mut msg = DynamicMessage::new(desc);
    set_field(&mut msg, "after_seq", "42").expect("a count");
    let e = set_field(&mut msg, "after_seq", "-1").expect_err("not a count");
    assert!(e.message().contains("after_seq"), "{e:?}");
    let e = set_field(&mut msg, "nothing", "1").expect_err("no such field");
    assert_eq!(e.code(), Code::InvalidArgument);
}

#[test]
fn json_is_strict() {
    let pool = pool();
    let desc = pool
        .get_message_by_name("corral.v1.CreateSandboxRequest")
        .expect("CreateSandboxRequest");
    let m = parse_message(
        desc.clone(),
        br#"{"id": "a", "spec": {"memory_bytes": 1048576}}"#,
    )
    .expect("a request");
    let typed: crate::pb::CreateSandboxRequest = m.transcode_to().expect("typed");
    assert_eq!(typed.spec.expect("spec").memory_bytes, 1 << 20);
    for bad in [
        &br#"{"id": "a", "nope": 1}"#[..],
        br#"{"id": 7}"#,
        br#"{"id": "a"} {"id": "b"}"#,
        b"[",
    ] {
        let e = parse_message(desc.clone(), bad).expect_err("refused");
        assert_eq!(e.code(), Code::InvalidArgument, "{bad:?}");
    }
}

#[test]
fn errors_carry_code_reason_and_flag() {
    let s = crate::reason::status(
        Code::PermissionDenied,
        crate::Reason::PolicyDenied,
        Some("--allow-network"),
        "not allowed",
    );
    let v = error_json(&s);
    assert_eq!(v["error"]["code"], "PERMISSION_DENIED");
    assert_eq!(v["error"]["reason"], "policy_denied");
    assert_eq!(v["error"]["flag"], "--allow-network");
    assert_eq!(code_of(s.code()).1, StatusCode::FORBIDDEN);
}

#[test]
fn the_document_describes_every_method_and_route() {
    let pool = pool();
    let services = ["corral.v1.Worker", "corral.v1.Control", "corral.v1.Admin"];
    let routes = routes_of(&services);
    assert!(routes.len() > worker_routes().len() + 10);
    // A worker's serve its own paths alone.
    assert_eq!(routes_of(&services[..1]).len(), worker_routes().len());
    let doc = openapi::document(&pool, &services, &routes);
    for name in services {
        let service = pool.get_service_by_name(name).expect(name);
        for m in service.methods() {
            let p = format!("/v1/{name}/{}", m.name());
            assert!(doc["paths"][&p]["post"].is_object(), "{p}");
        }
    }
    for r in &routes {
        let op = &doc["paths"][r.path][r.method.as_str().to_lowercase()];
        assert!(op.is_object(), "{} {}", r.method, r.path);
    }
    // Every reference names a schema of the document.
    let text = doc.to_string();
    for piece in text.split("\"#/components/schemas/").skip(1) {
        let name = piece.split('"').next().unwrap_or_default();
        assert!(doc["components"]["schemas"][name].is_object(), "{name}");
    }
}
