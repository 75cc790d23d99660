//! The build's tests.

use super::*;

/// A context as a tar stream, for tests: names written as given (`..`
/// and all, as a hostile client would).
fn tar_of(files: &[(&str, &[u8])]) -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    for (name, data) in files {
        let mut h = tar::Header::new_gnu();
        h.set_size(data.len() as u64);
        h.set_mode(0o644);
        h.as_old_mut().name[..name.len()].copy_from_slice(name.as_bytes());
        h.set_cksum();
        b.append(&h, *data).unwrap();
    }
    b.into_inner().unwrap()
}

#[test]
fn images_named_skip_stages_flags_and_comments() {
    let text = "# syntax=docker/dockerfile:1\nFROM --platform=linux/amd64 corral-debian AS build\nRUN make \\\n# a comment inside\n  all\nfrom build AS test\nFROM python:3.12\nCOPY --from=build /a /a\nCOPY --from=0 /a /b\nCOPY --from=alpine:3 /etc/x /x\nONBUILD COPY --from=busybox /bin/sh /sh\n";
    assert_eq!(
        images_named(text).unwrap(),
        vec!["corral-debian", "python:3.12", "alpine:3", "busybox"]
    );
}

#[test]
fn what_the_engine_could_read_otherwise_or_fetch_itself_is_refused() {
    let denied = |t: &str| matches!(images_named(t), Err(WorkerError::Denied { .. }));
    let invalid = |t: &str| matches!(images_named(t), Err(WorkerError::Invalid(_)));
    assert!(denied("ARG BASE=corral-debian\nFROM $BASE\n"));
    assert!(invalid("FROM\n"));
    assert!(invalid("\u{feff}FROM alpine:3\n"));
    assert!(invalid(
        "# escape=`\nFROM corral-debian\nRUN echo `\nFROM alpine:3\n"
    ));
    assert!(invalid("# Escape = `\nFROM corral-debian\n"));
    assert!(invalid(
        "FROM corral-debian\nRUN echo \\\u{a0}\nFROM alpine:3\n"
    ));
    assert!(invalid(
        "FROM corral-debian\nRUN echo \\\u{b}\nFROM alpine:3\n"
    ));
    assert!(denied(
        "FROM corral-debian\nADD http://127.0.0.1:8080/x /x\n"
    ));
    assert!(denied(
        "FROM corral-debian\nADD [\"https://example.com/x\", \"/x\"]\n"
    ));
    assert!(denied(
        "FROM corral-debian\nONBUILD ADD http://169.254.169.254/ /x\n"
    ));
    assert!(denied("FROM corral-debian\nCOPY --from=$IMG /a /a\n"));
    // A continuation ends at space and tab only, as the engine's does.
    assert_eq!(
        images_named("FROM corral-debian\nRUN echo \\ \t\nFROM python:3.12\n").unwrap(),
        vec!["corral-debian"]
    );
}

#[test]
fn the_dockerfile_path_stays_in_the_context() {
    assert_eq!(dockerfile_path("").unwrap(), "Dockerfile");
    assert_eq!(
        dockerfile_path("./env/Dockerfile").unwrap(),
        "env/Dockerfile"
    );
    for bad in ["/etc/passwd", "../Dockerfile", "a/../../b", ".", "a\0b"] {
        assert!(dockerfile_path(bad).is_err(), "{bad:?}");
    }
}

#[test]
fn steps_are_read_from_the_output() {
    let mut s = Steps::default();
    s.saw("Step 1/3 : FROM corral-debian\n ---> abc\n");
    s.saw("Step 2/3 : RUN false\n");
    let f = s.failure(FailureKind::StepFailed, " boom \n".into());
    assert_eq!((f.step, f.steps), (2, 3));
    assert_eq!(f.instruction, "RUN false");
    assert_eq!(f.message, "boom");
}

#[test]
fn output_pieces_are_bounded_and_whole_characters() {
    let text = "é".repeat(MAX_OUTPUT_PIECE);
    let p = pieces(&text);
    assert!(p.iter().all(|x| x.len() <= MAX_OUTPUT_PIECE));
    assert_eq!(p.concat(), text);
}

#[test]
fn the_engine_gets_the_dockerfile_the_worker_read_and_nothing_it_would_read_otherwise() {
    let dir = tempfile::tempdir().unwrap();
    let (src, dst) = (dir.path().join("c.tar"), dir.path().join("d.tar"));
    // `a/../Dockerfile` is the engine's Dockerfile, after the other.
    std::fs::write(
        &src,
        tar_of(&[
            ("Dockerfile", b"FROM corral-debian\n"),
            ("./a/../Dockerfile", b"FROM alpine:3\n"),
            ("x", b"y"),
        ]),
    )
    .unwrap();
    let text = clean_context(&src, &dst, "Dockerfile", 1 << 20).unwrap();
    assert_eq!(text.as_deref(), Some("FROM alpine:3\n"));
    let mut names = Vec::new();
    let mut checked = String::new();
    let mut a = tar::Archive::new(std::fs::File::open(&dst).unwrap());
    for e in a.entries().unwrap() {
        let mut e = e.unwrap();
        let n = String::from_utf8(e.path_bytes().into_owned()).unwrap();
        if n == CHECKED_DOCKERFILE {
            e.read_to_string(&mut checked).unwrap();
        }
        names.push(n);
    }
    assert_eq!(names, ["Dockerfile", "Dockerfile", "x", CHECKED_DOCKERFILE]);
    assert_eq!(checked, "FROM alpine:3\n");
    assert_eq!(clean_context(&src, &dst, "missing", 1 << 20).unwrap(), None);
    for bad in ["../x", "/etc/x", "a/../../x"] {
        std::fs::write(&src, tar_of(&[(bad, b"y")])).unwrap();
        assert!(
            clean_context(&src, &dst, "Dockerfile", 1 << 20).is_err(),
            "{bad}"
        );
    }
    std::fs::write(&src, tar_of(&[("big", &[0u8; 4096])])).unwrap();
    assert!(matches!(
        clean_context(&src, &dst, "Dockerfile", 1000),
        Err(WorkerError::Denied { .. })
    ));
    std::fs::write(&src, b"not a tar").unwrap();
    assert!(!matches!(
        clean_context(&src, &dst, "Dockerfile", 1 << 20),
        Ok(Some(_))
    ));
}
