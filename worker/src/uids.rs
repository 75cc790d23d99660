//! Which uid a sandbox's commands run as: one no host account holds, and
//! no other sandbox on the engine, so neither a local user nor another
//! sandbox may signal its processes, read their memory or environment, or
//! share its per-user kernel limits (inotify instances, ...).
//!
//! The worker picks at random from its range (`--sandbox-uids`), labels the
//! container with it, and checks after the create that no other container
//! on the engine (any worker's) carries the same label; a clash is removed
//! and picked again. Two workers racing for one uid both see the other.

use std::fmt;
use std::str::FromStr;

/// A range of uids, both ends included.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UidRange {
    pub first: u32,
    pub last: u32,
}

/// The default on an engine that runs containers with the host's uids:
/// the range systemd leaves unused (above its container ranges, below the
/// foreign range and the signed 32-bit trouble), where no distribution
/// puts accounts and `useradd` puts no subordinate ids.
pub const DEFAULT: UidRange = UidRange {
    first: 0x7000_0000,
    last: 0x7FFD_FFFF,
};

/// The default on an engine that maps container uids into a user
/// namespace (rootless Docker, `userns-remap`): only 0–65535 exist there,
/// each already a host uid no account holds.
pub const DEFAULT_REMAPPED: UidRange = UidRange {
    first: 10_000,
    last: 59_999,
};

/// The container label that names a sandbox's uid.
pub const LABEL_UID: &str = "corral.uid";

impl UidRange {
    pub fn count(&self) -> u64 {
        u64::from(self.last) - u64::from(self.first) + 1
    }

    /// A uid of the range, at random.
    pub fn pick(&self) -> u32 {
        let r = uuid::Uuid::new_v4().as_u128();
        self.first + (r % u128::from(self.count())) as u32
    }

    /// Refuses a range that holds root, nobody or an invalid id, or is too
    /// small to spread sandboxes over.
    pub fn check(&self) -> Result<(), String> {
        let special = [0, 65_534, 65_535, u32::MAX];
        if self.first > self.last {
            return Err(format!("{self}: the first uid is above the last"));
        }
        if let Some(s) = special
            .iter()
            .find(|s| (self.first..=self.last).contains(s))
        {
            return Err(format!("{self} holds uid {s}, which no sandbox may have"));
        }
        if self.count() < 1024 {
            return Err(format!(
                "{self} holds {} uids; give at least 1024",
                self.count()
            ));
        }
        Ok(())
    }

    /// What in the host's user database (`/etc/passwd`) and subordinate id
    /// ranges (`/etc/subuid`) this range overlaps, one line each.
    pub fn host_overlaps(&self, passwd: &str, subuid: &str) -> Vec<String> {
        let inside = |u: u64| (u64::from(self.first)..=u64::from(self.last)).contains(&u);
        let mut found = Vec::new();
        for line in passwd.lines() {
            let f: Vec<&str> = line.split(':').collect();
            if let Some(uid) = f.get(2).and_then(|u| u.parse::<u64>().ok())
                && inside(uid)
            {
                found.push(format!("account {} (uid {uid}) in /etc/passwd", f[0]));
            }
        }
        for line in subuid.lines() {
            let f: Vec<&str> = line.split(':').collect();
            if let (Some(start), Some(count)) = (
                f.get(1).and_then(|u| u.parse::<u64>().ok()),
                f.get(2).and_then(|u| u.parse::<u64>().ok()),
            ) && count > 0
                && start <= u64::from(self.last)
                && start + count > u64::from(self.first)
            {
                found.push(format!(
                    "subordinate uids {start}-{} of {} in /etc/subuid",
                    start + count - 1,
                    f[0]
                ));
            }
        }
        found
    }
}

impl fmt::Display for UidRange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}-{}", self.first, self.last)
    }
}

impl FromStr for UidRange {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let (a, b) = s
            .split_once('-')
            .ok_or_else(|| format!("{s:?}: give FIRST-LAST, e.g. {DEFAULT}"))?;
        let num = |x: &str| {
            x.trim()
                .parse::<u32>()
                .map_err(|e| format!("{s:?}: {x:?} is not a uid: {e}"))
        };
        let range = UidRange {
            first: num(a)?,
            last: num(b)?,
        };
        range.check()?;
        Ok(range)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_parse_and_refuse_what_no_sandbox_may_hold() {
        assert_eq!(
            "100000-200000".parse(),
            Ok(UidRange {
                first: 100_000,
                last: 200_000
            })
        );
        assert!("0-5000".parse::<UidRange>().unwrap_err().contains("uid 0"));
        assert!(
            "60000-70000"
                .parse::<UidRange>()
                .unwrap_err()
                .contains("65534")
        );
        assert!(
            "5000-5100"
                .parse::<UidRange>()
                .unwrap_err()
                .contains("at least 1024")
        );
        assert!("9-5".parse::<UidRange>().unwrap_err().contains("above"));
        assert!("x-5".parse::<UidRange>().is_err());
        assert!("5000".parse::<UidRange>().is_err());
        DEFAULT.check().unwrap();
        DEFAULT_REMAPPED.check().unwrap();
    }

    #[test]
    fn picks_stay_in_the_range_and_spread() {
        let r = UidRange {
            first: 70_000,
            last: 71_023,
        };
        let picks: std::collections::HashSet<u32> = (0..200).map(|_| r.pick()).collect();
        assert!(picks.iter().all(|u| (70_000..=71_023).contains(u)));
        assert!(picks.len() > 150, "{}", picks.len());
    }

    #[test]
    fn overlaps_with_host_accounts_and_subordinate_ids_are_named() {
        let r = UidRange {
            first: 100_000,
            last: 200_000,
        };
        let passwd = "root:x:0:0::/root:/bin/sh\nalice:x:1000:1000::/home/alice:/bin/sh\n\
                      svc:x:150000:150000::/:/bin/false\n";
        let subuid = "alice:100000:65536\nbob:300000:65536\n";
        assert_eq!(
            r.host_overlaps(passwd, subuid),
            [
                "account svc (uid 150000) in /etc/passwd",
                "subordinate uids 100000-165535 of alice in /etc/subuid"
            ]
        );
        assert!(DEFAULT.host_overlaps(passwd, subuid).is_empty());
    }
}
