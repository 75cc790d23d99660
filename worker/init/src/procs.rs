//! The processes of the sandbox, as `/proc` shows them: enough to kill an
//! operation's whole session (its process group and any group a shell's
//! job control made in it) and every process carrying its tag (below), to
//! tell its keeper (see [`crate::keeper`]) to kill what left the session,
//! and to count what a reset kills.
//!
//! The tag: each command starts with one supplementary group of its
//! operation's own ([`tag`]), which it and all it starts keep (dropping or
//! changing supplementary groups needs `CAP_SETGID`, which no command
//! has). It opens nothing (no file has that group) and marks membership
//! where the keeper cannot: under gVisor, where only PID 1 may be a
//! subreaper, a process that leaves the session and is orphaned goes to
//! PID 1, but still carries its operation's tag, and is killed with it.

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

/// Pid and `/proc/PID/stat` line of every process in `/proc`.
fn stats() -> impl Iterator<Item = (i32, String)> {
    std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|entry| {
            let pid: i32 = entry.file_name().to_str()?.parse().ok()?;
            Some((
                pid,
                std::fs::read_to_string(entry.path().join("stat")).ok()?,
            ))
        })
}

/// The first gid of operation tags: far above any account or sandbox uid
/// (Corral's sandbox uids end below 2^31), below the invalid `(gid_t)-1`.
const TAG_BASE: u32 = 4_000_000_000;
/// How many tags there are before they are used again.
const TAG_SPAN: u32 = 1 << 24;

/// The tag gid of the `n`th operation of this supervisor.
pub fn tag(n: u64) -> u32 {
    TAG_BASE + (n % u64::from(TAG_SPAN)) as u32
}

/// Whether the supplementary groups of a `/proc/PID/status` text hold `tag`.
fn carries(status: &str, tag: u32) -> bool {
    status
        .lines()
        .find_map(|l| l.strip_prefix("Groups:"))
        .is_some_and(|groups| groups.split_whitespace().any(|g| g.parse() == Ok(tag)))
}

/// Every process (its pid) whose supplementary groups hold `tag`.
fn tagged(tag: u32) -> Vec<i32> {
    std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|entry| {
            let pid: i32 = entry.file_name().to_str()?.parse().ok()?;
            let status = std::fs::read_to_string(entry.path().join("status")).ok()?;
            carries(&status, tag).then_some(pid)
        })
        .collect()
}

/// Pid and session id of every process in `/proc`.
fn sessions() -> impl Iterator<Item = (i32, i32)> {
    stats().filter_map(|(pid, stat)| Some((pid, session_of(&stat)?)))
}

/// Pid and parent pid of every process in `/proc`.
pub fn parents() -> Vec<(i32, i32)> {
    stats()
        .filter_map(|(pid, stat)| Some((pid, parent_of(&stat)?)))
        .collect()
}

/// Every descendant of `root`, as `/proc` shows them now.
pub fn descendants(root: i32) -> Vec<i32> {
    let parents = parents();
    let mut found = vec![root];
    let mut i = 0;
    while i < found.len() {
        let of = found[i];
        found.extend(
            parents
                .iter()
                .filter(|(pid, parent)| *parent == of && *pid != root)
                .map(|(pid, _)| *pid),
        );
        i += 1;
    }
    found.remove(0);
    found
}

/// The parent field of a `/proc/PID/stat` line: the second after the
/// command name.
fn parent_of(stat: &str) -> Option<i32> {
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_whitespace().nth(1)?.parse().ok()
}

/// The session field of a `/proc/PID/stat` line: the fourth after the
/// command name, which is in parentheses and may hold anything.
fn session_of(stat: &str) -> Option<i32> {
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_whitespace().nth(3)?.parse().ok()
}

/// Kills the operation whose keeper leads the session `sid`: the keeper,
/// while it lives (`keeper_alive`: not yet reaped, so its pid is still
/// its own), is told to kill everything it keeps, and every other process
/// of the session, or carrying the operation's `tag`, gets SIGKILL.
/// Returns whether any process was found.
pub fn kill_session(sid: Pid, tag: Option<u32>, keeper_alive: bool) -> bool {
    let mut found = keeper_alive && kill(sid, Signal::SIGUSR1).is_ok();
    for (pid, session) in sessions() {
        if session == sid.as_raw()
            && pid != sid.as_raw()
            && kill(Pid::from_raw(pid), Signal::SIGKILL).is_ok()
        {
            found = true;
        }
    }
    for pid in tag.map(tagged).unwrap_or_default() {
        if pid != sid.as_raw() && kill(Pid::from_raw(pid), Signal::SIGKILL).is_ok() {
            found = true;
        }
    }
    found
}

/// Tells the keeper of session `sid`, while it lives, that its operation
/// is ending: what it left in the background goes with its command.
pub fn ending(sid: Pid, keeper_alive: bool) {
    if keeper_alive {
        let _ = kill(sid, Signal::SIGUSR2);
    }
}

/// Processes a reset by `me` kills: as PID 1, all the others; outside a
/// sandbox (tests), those of the `sessions` given.
pub fn count(me: u32, sessions_of_ops: &[Pid]) -> u32 {
    sessions()
        .filter(|(pid, sid)| {
            *pid != me as i32 && (me == 1 || sessions_of_ops.iter().any(|s| s.as_raw() == *sid))
        })
        .count() as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_session_is_read_past_any_command_name() {
        let stat = "42 (a) b) (c) S 1 40 41 0 -1 4194560";
        assert_eq!(session_of(stat), Some(41));
        assert_eq!(session_of("7 (sh) R 1 7 7 0"), Some(7));
        assert_eq!(session_of("garbage"), None);
        assert_eq!(parent_of(stat), Some(1));
        assert_eq!(parent_of("7 (sh) R 9 7 7 0"), Some(9));
    }

    #[test]
    fn a_tag_is_found_among_the_supplementary_groups_only() {
        let t = tag(3);
        assert_eq!(t, 4_000_000_003);
        assert_eq!(tag(u64::from(TAG_SPAN) + 3), t, "tags are used again");
        let status = |gid: &str, groups: &str| {
            format!("Name:\tsh\nGid:\t{gid}\t{gid}\t{gid}\t{gid}\nGroups:\t{groups}\nPid:\t9\n")
        };
        assert!(carries(&status("1879048200", "4000000003 "), t));
        // gVisor's form: a blank before the list.
        assert!(carries(&status("1879048200", " 1879048200 4000000003 "), t));
        assert!(
            !carries(&status("4000000003", ""), t),
            "the primary gid is no tag"
        );
        assert!(!carries(&status("1879048200", "40000000031"), t));
        assert!(!carries("Name:\tsh\n", t));
    }
}
