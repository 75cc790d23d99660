//! The worker decides what a sandbox may be. A client asks (its
//! `SandboxSpec`); the operator's policy ([`SandboxPolicy`], from the
//! worker's flags) allows or refuses each loosening of the hardened
//! defaults, and some capabilities are never granted at all: with any of
//! them a command in a sandbox can take over its host (the cgroup v1
//! `release_agent` escape needs only `CAP_SYS_ADMIN`).

use corral_proto::{NetworkMode, SandboxPolicy, SandboxSpec};

use crate::error::WorkerError;

/// Capabilities no policy grants: each lets a sandbox reach into the
/// kernel or the host (mounts, modules, raw devices, other processes'
/// memory, the audit and MAC layers, the clock, BPF).
pub const NEVER_GRANTED: &[&str] = &[
    "CAP_SYS_ADMIN",
    "CAP_SYS_MODULE",
    "CAP_SYS_PTRACE",
    "CAP_DAC_READ_SEARCH",
    "CAP_SYS_RAWIO",
    "CAP_SYS_BOOT",
    "CAP_SYS_TIME",
    "CAP_SYSLOG",
    "CAP_MAC_ADMIN",
    "CAP_MAC_OVERRIDE",
    "CAP_NET_ADMIN",
    "CAP_BPF",
    "CAP_PERFMON",
    "CAP_LINUX_IMMUTABLE",
    "CAP_AUDIT_CONTROL",
    "CAP_AUDIT_READ",
    "CAP_BLOCK_SUSPEND",
    "CAP_WAKE_ALARM",
    "CAP_SYS_RESOURCE",
];

/// `cap` (a normalized name) is never granted.
fn never_granted(cap: &str) -> bool {
    cap == "CAP_ALL" || NEVER_GRANTED.contains(&cap)
}

/// `chown`, `CHOWN` and `CAP_CHOWN` all name `CAP_CHOWN`.
pub fn capability_name(name: &str) -> String {
    let upper = name.trim().to_ascii_uppercase();
    if upper.starts_with("CAP_") {
        upper
    } else {
        format!("CAP_{upper}")
    }
}

/// Docker's own default capabilities: what a plain `docker run` grants.
pub const DOCKER_DEFAULT_CAPABILITIES: &[&str] = &[
    "CAP_CHOWN",
    "CAP_DAC_OVERRIDE",
    "CAP_FOWNER",
    "CAP_FSETID",
    "CAP_KILL",
    "CAP_SETGID",
    "CAP_SETUID",
    "CAP_SETPCAP",
    "CAP_NET_BIND_SERVICE",
    "CAP_NET_RAW",
    "CAP_SYS_CHROOT",
    "CAP_MKNOD",
    "CAP_AUDIT_WRITE",
    "CAP_SETFCAP",
];

/// What a plain `docker run` allows, and never more: for a worker embedded
/// in the `corral` of a user who runs the Docker engine anyway.
pub fn permissive() -> SandboxPolicy {
    SandboxPolicy {
        allow_root: true,
        allow_writable_rootfs: true,
        allow_network: true,
        allowed_capabilities: DOCKER_DEFAULT_CAPABILITIES
            .iter()
            .map(|c| c.to_string())
            .collect(),
        allowed_images: Vec::new(),
        allow_any_image: true,
        allowed_runtimes: vec!["runsc".into()],
        // `docker build` is the user's anyway.
        allow_build: true,
        // As many CPUs as the host has, not the default ceiling's 16.
        ceilings: corral_proto::Ceilings {
            cpu_millis: std::thread::available_parallelism()
                .map_or(1, std::num::NonZeroUsize::get)
                .saturating_mul(1000) as u32,
            ..Default::default()
        },
        // A plain `docker run` reaches everything; egress by policy, with
        // the internal ranges always refused, is narrower.
        allowed_egress: vec![corral_proto::egress::Rule {
            dest: corral_proto::egress::Dest::Any,
            port: None,
        }],
    }
}

/// Whether every rule of `rules` falls within the worker's
/// `--allow-egress` bounds.
pub fn check_egress(
    policy: &SandboxPolicy,
    rules: &[corral_proto::egress::Rule],
) -> Result<(), WorkerError> {
    for rule in rules {
        if !policy.allowed_egress.iter().any(|b| b.covers(rule)) {
            let bounds = if policy.allowed_egress.is_empty() {
                "this worker gives no sandbox egress".to_string()
            } else {
                format!(
                    "this worker allows egress only within {}",
                    policy
                        .allowed_egress
                        .iter()
                        .map(ToString::to_string)
                        .collect::<Vec<_>>()
                        .join(", ")
                )
            };
            return Err(denied(
                Some("--allow-egress"),
                format!(
                    "egress rule {rule}: {bounds} (its operator allows it with corral-worker --allow-egress {rule})"
                ),
            ));
        }
    }
    Ok(())
}

/// Why an operator's policy cannot be used.
pub fn check_policy(policy: &SandboxPolicy) -> Result<(), String> {
    for cap in &policy.allowed_capabilities {
        let cap = capability_name(cap);
        if never_granted(&cap) {
            return Err(format!(
                "--allow-cap {cap}: this capability is never granted to a sandbox (it lets a sandbox take over its host)"
            ));
        }
    }
    Ok(())
}

/// Corral's own images, built on the worker's host from Debian packages
/// (deploy/images): allowed like the default one.
pub const STOCK_IMAGES: [&str; 2] = ["corral-sandbox:latest", "corral-debian:latest"];

/// An image reference as Docker reads it: no tag means `:latest`, and
/// Docker Hub's own prefixes (`docker.io/`, `docker.io/library/`,
/// `index.docker.io/`) are the same as none.
pub fn normalize_image(image: &str) -> String {
    let mut name = image;
    for hub in [
        "docker.io/library/",
        "index.docker.io/library/",
        "docker.io/",
        "index.docker.io/",
    ] {
        if let Some(rest) = name.strip_prefix(hub) {
            name = rest;
            break;
        }
    }
    let last = name.rsplit('/').next().unwrap_or(name);
    if last.contains(':') || name.contains('@') {
        name.to_string()
    } else {
        format!("{name}:latest")
    }
}

/// The repository of the images a worker builds (`corral-build:<digest>`).
pub const BUILT_IMAGES: &str = "corral-build:";

/// Whether `image` is one this worker's builds name: `corral-build:` and
/// 32 lower-case hex digits, nothing else (`corral-build:5000/x` names a
/// registry).
pub fn is_built_image(image: &str) -> bool {
    image
        .strip_prefix(BUILT_IMAGES)
        .is_some_and(|d| d.len() == 32 && d.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')))
}

pub(crate) fn image_allowed(policy: &SandboxPolicy, image: &str, default_image: &str) -> bool {
    let image = normalize_image(image);
    policy.allow_any_image
        || (policy.allow_build && is_built_image(&image))
        || image == normalize_image(default_image)
        || STOCK_IMAGES.contains(&image.as_str())
        || policy
            .allowed_images
            .iter()
            .any(|p| match p.strip_suffix('*') {
                Some(prefix) => image.starts_with(prefix),
                None => image == normalize_image(p),
            })
}

fn denied(flag: Option<&'static str>, what: String) -> WorkerError {
    WorkerError::Denied { flag, what }
}

/// Whether `spec` stays within `policy`; the error names the worker flag
/// that would allow what was refused.
pub fn check(
    policy: &SandboxPolicy,
    spec: &SandboxSpec,
    default_image: &str,
    default_runtime: Option<&str>,
) -> Result<(), WorkerError> {
    if let Some(r) = &spec.runtime
        && Some(r.as_str()) != default_runtime
        && !policy.allowed_runtimes.contains(r)
    {
        return Err(denied(
            Some("--allow-runtime"),
            format!(
                "this worker runs no sandbox under runtime {r:?} (its operator allows it with corral-worker --allow-runtime {r})"
            ),
        ));
    }
    if spec.run_as_root && !policy.allow_root {
        return Err(denied(
            Some("--allow-root"),
            "this worker runs no sandbox as root (its operator allows it with corral-worker --allow-root)".into(),
        ));
    }
    if spec.writable_rootfs && !policy.allow_writable_rootfs {
        return Err(denied(
            Some("--allow-writable-rootfs"),
            "this worker gives no sandbox a writable root filesystem (its operator allows it with corral-worker --allow-writable-rootfs)".into(),
        ));
    }
    if spec.network != NetworkMode::None && !policy.allow_network {
        return Err(denied(
            Some("--allow-network"),
            "this worker gives no sandbox a network (its operator allows it with corral-worker --allow-network)".into(),
        ));
    }
    check_egress(policy, &spec.egress)?;
    // A proxy that could never let anything through is refused as clearly.
    if spec.egress_proxy && policy.allowed_egress.is_empty() {
        return Err(denied(
            Some("--allow-egress"),
            "egress proxy: this worker gives no sandbox egress (its operator allows it with corral-worker --allow-egress RULE)".into(),
        ));
    }
    for cap in &spec.add_capabilities {
        let cap = capability_name(cap);
        if never_granted(&cap) {
            return Err(denied(
                None,
                format!(
                    "{cap} is never granted to a sandbox: it lets a sandbox take over its host"
                ),
            ));
        }
        if !policy
            .allowed_capabilities
            .iter()
            .any(|a| capability_name(a) == cap)
        {
            return Err(denied(
                Some("--allow-cap"),
                format!(
                    "this worker grants no sandbox {cap} (its operator allows it with corral-worker --allow-cap {cap})"
                ),
            ));
        }
    }
    let image = spec.image.as_deref().unwrap_or(default_image);
    if !image_allowed(policy, image, default_image) {
        return Err(denied(
            Some("--allow-image"),
            format!(
                "image {image:?} is not on this worker's list (its operator allows it with corral-worker --allow-image {image})"
            ),
        ));
    }
    check_ceilings(&policy.ceilings, spec)
}

/// Whether what `spec` asks for is within the operator's ceilings.
fn check_ceilings(c: &corral_proto::Ceilings, spec: &SandboxSpec) -> Result<(), WorkerError> {
    let over = |what: &str, asked: String, most: String, flag: &'static str| {
        Err(denied(
            Some(flag),
            format!(
                "{what} {asked} is more than this worker gives a sandbox ({most}; its operator raises the ceiling with corral-worker {flag})"
            ),
        ))
    };
    if let Some(m) = spec.memory_bytes
        && m > c.memory_bytes
    {
        return over("memory", size(m), size(c.memory_bytes), "--max-memory");
    }
    if let Some(n) = spec.cpu_millis
        && n > c.cpu_millis
    {
        let cpus = |m: u32| format!("{} CPUs", f64::from(m) / 1000.0);
        return over("a CPU limit of", cpus(n), cpus(c.cpu_millis), "--max-cpus");
    }
    if let Some(n) = spec.pids_limit
        && n > c.pids
    {
        return over(
            "a limit of",
            format!("{n} processes"),
            format!("at most {}", c.pids),
            "--max-pids",
        );
    }
    if let Some(w) = spec.workspace_bytes
        && w > c.workspace_bytes
    {
        return over(
            "a workspace of",
            size(w),
            size(c.workspace_bytes),
            "--max-workspace",
        );
    }
    if let Some(t) = spec.tmp_bytes
        && t > c.tmp_bytes
    {
        return over("a /tmp of", size(t), size(c.tmp_bytes), "--max-tmp");
    }
    Ok(())
}

/// Bytes as the flags take them: `512m`, `16g`.
fn size(n: u64) -> String {
    const UNITS: [(u64, &str); 4] = [
        (1 << 50, "p"),
        (1 << 40, "t"),
        (1 << 30, "g"),
        (1 << 20, "m"),
    ];
    for (unit, name) in UNITS {
        if n >= unit {
            let v = n as f64 / unit as f64;
            return if n.is_multiple_of(unit) {
                format!("{}{name}", n / unit)
            } else {
                format!("{v:.1}{name}")
            };
        }
    }
    format!("{n} bytes")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec() -> SandboxSpec {
        SandboxSpec::default()
    }

    #[test]
    fn the_default_policy_refuses_every_loosening_and_says_which_flag_allows_it() {
        let p = SandboxPolicy::default();
        assert!(check(&p, &spec(), "img", None).is_ok());
        let cases: Vec<(SandboxSpec, &str)> = vec![
            (
                SandboxSpec {
                    run_as_root: true,
                    ..spec()
                },
                "--allow-root",
            ),
            (
                SandboxSpec {
                    writable_rootfs: true,
                    ..spec()
                },
                "--allow-writable-rootfs",
            ),
            (
                SandboxSpec {
                    network: NetworkMode::Bridge,
                    ..spec()
                },
                "--allow-network",
            ),
            (
                SandboxSpec {
                    add_capabilities: vec!["CAP_CHOWN".into()],
                    ..spec()
                },
                "--allow-cap CAP_CHOWN",
            ),
            (
                SandboxSpec {
                    image: Some("alpine".into()),
                    ..spec()
                },
                "--allow-image alpine",
            ),
            (
                SandboxSpec {
                    runtime: Some("runsc".into()),
                    ..spec()
                },
                "--allow-runtime runsc",
            ),
            (
                SandboxSpec {
                    egress_proxy: true,
                    ..spec()
                },
                "--allow-egress",
            ),
        ];
        for (s, flag) in cases {
            let e = check(&p, &s, "img", None).unwrap_err().to_string();
            assert!(e.contains(flag), "{e}");
        }
    }

    #[test]
    fn some_capabilities_are_never_granted_whatever_the_policy() {
        let p = SandboxPolicy {
            allowed_capabilities: vec!["CAP_CHOWN".into()],
            allow_root: true,
            ..SandboxPolicy::default()
        };
        for cap in ["CAP_SYS_ADMIN", "sys_admin", "ALL", "CAP_SYS_PTRACE"] {
            let s = SandboxSpec {
                add_capabilities: vec![cap.into()],
                ..spec()
            };
            let e = check(&p, &s, "img", None).unwrap_err().to_string();
            assert!(e.contains("never granted"), "{cap}: {e}");
        }
        let ok = SandboxSpec {
            add_capabilities: vec!["CAP_CHOWN".into()],
            run_as_root: true,
            ..spec()
        };
        assert!(check(&p, &ok, "img", None).is_ok());
        assert!(
            check_policy(&SandboxPolicy {
                allowed_capabilities: vec!["SYS_ADMIN".into()],
                ..SandboxPolicy::default()
            })
            .is_err()
        );
    }

    #[test]
    fn what_a_sandbox_asks_for_is_capped_by_the_operators_ceilings() {
        let p = SandboxPolicy::default();
        let cases: Vec<(SandboxSpec, &str)> = vec![
            (
                SandboxSpec {
                    pids_limit: Some(4_000_000),
                    ..spec()
                },
                "--max-pids",
            ),
            (
                SandboxSpec {
                    workspace_bytes: Some(1 << 50),
                    ..spec()
                },
                "--max-workspace",
            ),
            (
                SandboxSpec {
                    tmp_bytes: Some(1 << 40),
                    ..spec()
                },
                "--max-tmp",
            ),
            (
                SandboxSpec {
                    memory_bytes: Some(1 << 45),
                    ..spec()
                },
                "--max-memory",
            ),
            (
                SandboxSpec {
                    cpu_millis: Some(1_000_000),
                    ..spec()
                },
                "--max-cpus",
            ),
        ];
        for (s, flag) in cases {
            let e = check(&p, &s, "img", None).unwrap_err();
            assert!(matches!(e, WorkerError::Denied { .. }), "{e}");
            assert!(e.to_string().contains(flag), "{e}");
        }
        let e = check(
            &p,
            &SandboxSpec {
                workspace_bytes: Some(1 << 50),
                ..spec()
            },
            "img",
            None,
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("a workspace of 1p") && e.contains("16g"), "{e}");
        let within = SandboxSpec {
            pids_limit: Some(4096),
            workspace_bytes: Some(16 << 30),
            memory_bytes: Some(2 << 30),
            cpu_millis: Some(2000),
            ..spec()
        };
        assert!(check(&p, &within, "img", None).is_ok());
    }

    #[test]
    fn images_match_exactly_or_by_prefix() {
        let p = SandboxPolicy {
            allowed_images: vec!["python:3.12".into(), "corral-*".into()],
            ..SandboxPolicy::default()
        };
        let with = |i: &str| SandboxSpec {
            image: Some(i.into()),
            ..spec()
        };
        assert!(check(&p, &with("python:3.12"), "d", None).is_ok());
        assert!(check(&p, &with("corral-debian:1"), "d", None).is_ok());
        assert!(
            check(&p, &with("d"), "d", None).is_ok(),
            "the default image"
        );
        assert!(check(&p, &with("python:3.13"), "d", None).is_err());
        // As Docker reads them: no tag is :latest, Docker Hub's prefix is none.
        assert!(check(&p, &with("docker.io/library/python:3.12"), "d", None).is_ok());
        let stock = SandboxPolicy {
            allow_any_image: false,
            ..SandboxPolicy::default()
        };
        assert!(
            check(
                &stock,
                &with("corral-debian"),
                "corral-sandbox:latest",
                None
            )
            .is_ok()
        );
        assert!(
            check(
                &stock,
                &with("corral-sandbox"),
                "corral-sandbox:latest",
                None
            )
            .is_ok()
        );
        assert!(
            check(
                &stock,
                &with("corral-debian:old"),
                "corral-sandbox:latest",
                None
            )
            .is_err()
        );
    }

    #[test]
    fn only_the_names_builds_give_are_taken_for_built_images() {
        let built = format!("{BUILT_IMAGES}{}", "0123456789abcdef".repeat(2));
        assert!(is_built_image(&built));
        for not in [
            "corral-build:5000/evil",
            "corral-build:0000",
            "corral-build:0123456789ABCDEF0123456789ABCDEF",
            "corral-build:0123456789abcdef0123456789abcdef/x",
        ] {
            assert!(!is_built_image(not), "{not}");
        }
    }

    #[test]
    fn image_names_are_normalized_as_docker_does() {
        for (given, want) in [
            ("alpine", "alpine:latest"),
            ("alpine:3.20", "alpine:3.20"),
            ("docker.io/library/alpine", "alpine:latest"),
            ("docker.io/user/app:1", "user/app:1"),
            ("localhost:5000/app", "localhost:5000/app:latest"),
            ("localhost:5000/app:2", "localhost:5000/app:2"),
            ("alpine@sha256:abc", "alpine@sha256:abc"),
        ] {
            assert_eq!(normalize_image(given), want, "{given}");
        }
    }
}
