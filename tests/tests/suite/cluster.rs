//! Corral across three hosts: `corral-cluster-check` run inside a network
//! namespace made here (loopback up; a hosts file that names the three
//! workers' addresses `workers.cluster.test`). Needs root (namespaces,
//! iptables), as CI has. Teardown by PID (every process left in the
//! namespace), by label (the check removes its workers' containers) and by
//! namespace.

use std::process::Command;

use anyhow::{Context, Result, bail, ensure};

/// The namespace and its /etc/netns files, removed with every process in
/// it when dropped.
struct Netns(String);

impl Drop for Netns {
    fn drop(&mut self) {
        if let Ok(out) = Command::new("ip").args(["netns", "pids", &self.0]).output() {
            for pid in String::from_utf8_lossy(&out.stdout).split_whitespace() {
                if let Ok(pid) = pid.parse::<i32>() {
                    let _ = nix::sys::signal::kill(
                        nix::unistd::Pid::from_raw(pid),
                        nix::sys::signal::Signal::SIGKILL,
                    );
                }
            }
        }
        let _ = Command::new("ip").args(["netns", "del", &self.0]).status();
        let _ = std::fs::remove_dir_all(format!("/etc/netns/{}", self.0));
    }
}

fn ip(args: &[&str]) -> Result<()> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .context("running ip")?;
    ensure!(
        out.status.success(),
        "ip {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(())
}

#[test]
fn three_workers_in_a_network_namespace() -> Result<()> {
    if !nix::unistd::Uid::effective().is_root() {
        bail!(
            "this test makes a network namespace and firewall rules: run the suite as root (CI does)"
        );
    }
    let name = corral_e2e::unique_id("corral-t");
    ip(&["netns", "add", &name])?;
    let ns = Netns(name);
    ip(&["-n", &ns.0, "link", "set", "lo", "up"])?;
    // `ip netns exec` puts these over /etc/hosts and /etc/host.conf: the
    // name has three addresses ("multi on": all of them, not the first).
    let etc = format!("/etc/netns/{}", ns.0);
    std::fs::create_dir_all(&etc)?;
    std::fs::write(
        format!("{etc}/hosts"),
        "127.0.0.1 localhost\n127.0.1.1 workers.cluster.test\n127.0.1.2 workers.cluster.test\n127.0.1.3 workers.cluster.test\n",
    )?;
    std::fs::write(format!("{etc}/host.conf"), "multi on\n")?;
    let out = Command::new("ip")
        .args([
            "netns",
            "exec",
            &ns.0,
            env!("CARGO_BIN_EXE_corral-cluster-check"),
        ])
        .output()?;
    let report = String::from_utf8_lossy(&out.stdout);
    println!("{report}");
    ensure!(
        out.status.success(),
        "the cluster check failed:\n{report}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(())
}
