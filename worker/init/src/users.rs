//! The sandbox user's name. Each sandbox's commands run under a uid of
//! their own (the worker picks it from a range no host account holds), so
//! the image's user database cannot know it. The worker mounts a small
//! tmpfs at [`USERS_DIR`], writable by the supervisor only; before anything
//! runs, the supervisor writes a `passwd` and a `group` there: the image's
//! own entries (from `/etc/passwd.image` and `/etc/group.image`, or root's
//! and nobody's when the image has none), less any other claim to the
//! sandbox's name or uid, and the sandbox user itself. An image opts in by
//! making `/etc/passwd` and `/etc/group` symbolic links to those files
//! (Corral's images do); in any other image the uid simply has no name.

use std::io;
use std::path::Path;

/// Where the worker mounts the supervisor's tmpfs for the user database.
pub const USERS_DIR: &str = "/run/corral";
/// The sandbox user's name, whatever its uid.
pub const NAME: &str = "sandbox";

const BASE_PASSWD: &str = "root:x:0:0:root:/root:/bin/sh\n\
                           nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n";
const BASE_GROUP: &str = "root:x:0:\nnogroup:x:65534:\n";

/// The `passwd` and `group` texts for a sandbox whose commands run as
/// `uid` (none: as root), from the image's own texts.
pub fn entries(uid: Option<u32>, passwd: Option<&str>, group: Option<&str>) -> (String, String) {
    let keep = |text: &str, id: Option<u32>, id_field: usize| -> String {
        let mut out = String::new();
        for line in text.lines() {
            let fields: Vec<&str> = line.split(':').collect();
            let claims = id.is_some_and(|id| {
                fields.first() == Some(&NAME) || fields.get(id_field) == Some(&&*id.to_string())
            });
            if !line.trim().is_empty() && !claims {
                out.push_str(line);
                out.push('\n');
            }
        }
        out
    };
    let mut p = keep(passwd.unwrap_or(BASE_PASSWD), uid, 2);
    let mut g = keep(group.unwrap_or(BASE_GROUP), uid, 2);
    if let Some(uid) = uid {
        p.push_str(&format!(
            "{NAME}:x:{uid}:{uid}:{NAME}:{}:/bin/sh\n",
            corral_proto::limits::WORKSPACE_DIR
        ));
        g.push_str(&format!("{NAME}:x:{uid}:\n"));
    }
    (p, g)
}

/// Writes the user database into [`USERS_DIR`] (`dir` in tests). Returns
/// false when the directory is not there (a worker that mounts none).
pub fn write(dir: &Path, etc: &Path, uid: Option<u32>) -> io::Result<bool> {
    if !dir.is_dir() {
        return Ok(false);
    }
    let read = |name: &str| std::fs::read_to_string(etc.join(name)).ok();
    let (passwd, group) = entries(
        uid,
        read("passwd.image").as_deref(),
        read("group.image").as_deref(),
    );
    for (name, text) in [("passwd", passwd), ("group", group)] {
        let tmp = dir.join(format!(".{name}.tmp"));
        std::fs::write(&tmp, text)?;
        std::fs::rename(&tmp, dir.join(name))?;
    }
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_sandbox_user_replaces_any_other_claim_to_its_name_or_uid() {
        let image = "root:x:0:0:root:/root:/bin/bash\nsandbox:x:1000:1000::/workspace:/bin/bash\n\
                     squat:x:1879048200:5:::\nwww-data:x:33:33::/var/www:/usr/sbin/nologin\n";
        let group = "root:x:0:\nsandbox:x:1000:\nsquat:x:1879048200:\nwww-data:x:33:\n";
        let (p, g) = entries(Some(1879048200), Some(image), Some(group));
        assert_eq!(
            p,
            "root:x:0:0:root:/root:/bin/bash\nwww-data:x:33:33::/var/www:/usr/sbin/nologin\n\
             sandbox:x:1879048200:1879048200:sandbox:/workspace:/bin/sh\n"
        );
        assert_eq!(g, "root:x:0:\nwww-data:x:33:\nsandbox:x:1879048200:\n");
    }

    #[test]
    fn an_image_without_entries_gets_root_and_nobody() {
        let (p, g) = entries(None, None, None);
        assert_eq!(p, BASE_PASSWD);
        assert_eq!(g, BASE_GROUP);
        let (p, _) = entries(Some(7), None, None);
        assert!(
            p.ends_with("sandbox:x:7:7:sandbox:/workspace:/bin/sh\n"),
            "{p}"
        );
    }

    #[test]
    fn written_only_where_the_worker_made_room() {
        let d = tempfile::tempdir().unwrap();
        let missing = d.path().join("absent");
        assert!(!write(&missing, d.path(), Some(5)).unwrap());
        std::fs::write(d.path().join("passwd.image"), "root:x:0:0::/:/bin/sh\n").unwrap();
        let users = d.path().join("users");
        std::fs::create_dir(&users).unwrap();
        assert!(write(&users, d.path(), Some(5)).unwrap());
        assert_eq!(
            std::fs::read_to_string(users.join("passwd")).unwrap(),
            "root:x:0:0::/:/bin/sh\nsandbox:x:5:5:sandbox:/workspace:/bin/sh\n"
        );
        assert_eq!(
            std::fs::read_to_string(users.join("group")).unwrap(),
            "root:x:0:\nnogroup:x:65534:\nsandbox:x:5:\n"
        );
    }
}
