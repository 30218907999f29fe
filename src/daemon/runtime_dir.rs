//! The runtime directory: where the worker sockets (and other run-time files)
//! live. It is the daemon's own, whatever the umask it was started with:
//!
//! * The process umask is set to `077` (owner only), or `007` when
//!   `server.runtime_group` names a group that may also use the sockets, so
//!   every socket and file the daemon creates is `0600`/`0700` (or
//!   `0660`/`0770`).
//! * A missing directory is created `0700` (`0770` with a group, owned by
//!   that group).
//! * An existing directory must belong to the daemon's user and must not be
//!   writable by others (nor by its group, unless that is the configured
//!   group); otherwise start-up fails and says why — another user who can
//!   write there could replace a worker's socket.

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;

/// Why the runtime directory cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum RuntimeDirError {
    #[error("server.runtime_dir {path}: {message}")]
    Unsafe { path: String, message: String },
    #[error("server.runtime_dir {path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("server.runtime_group: no group named {0:?}")]
    NoSuchGroup(String),
}

/// The numeric id of group `name`.
fn group_id(name: &str) -> Result<u32, RuntimeDirError> {
    let c = std::ffi::CString::new(name).map_err(|_| RuntimeDirError::NoSuchGroup(name.into()))?;
    // SAFETY: getgrnam returns a pointer into static storage or null; we read
    // one field immediately, on this thread.
    let g = unsafe { libc::getgrnam(c.as_ptr()) };
    if g.is_null() {
        return Err(RuntimeDirError::NoSuchGroup(name.into()));
    }
    // SAFETY: non-null, points at a valid group entry.
    Ok(unsafe { (*g).gr_gid })
}

/// Sets the umask and creates or checks `dir` (see the module docs).
pub fn prepare(dir: &Path, group: Option<&str>) -> Result<(), RuntimeDirError> {
    let gid = group.map(group_id).transpose()?;
    // SAFETY: umask only changes this process's file-creation mask.
    unsafe {
        libc::umask(if gid.is_some() { 0o007 } else { 0o077 });
    }
    let path = dir.display().to_string();
    let io = |source| RuntimeDirError::Io {
        path: path.clone(),
        source,
    };
    let mode = if gid.is_some() { 0o770 } else { 0o700 };
    if !dir.exists() {
        std::fs::create_dir_all(dir).map_err(io)?;
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(mode)).map_err(io)?;
        if let Some(gid) = gid {
            std::os::unix::fs::chown(dir, None, Some(gid)).map_err(io)?;
        }
    }
    check(dir, gid)
}

/// Checks an existing directory's owner and mode.
pub fn check(dir: &Path, group: Option<u32>) -> Result<(), RuntimeDirError> {
    let path = dir.display().to_string();
    let unsafe_dir = |message: String| RuntimeDirError::Unsafe {
        path: path.clone(),
        message,
    };
    let meta = std::fs::symlink_metadata(dir).map_err(|source| RuntimeDirError::Io {
        path: path.clone(),
        source,
    })?;
    if !meta.is_dir() {
        return Err(unsafe_dir("is not a directory".into()));
    }
    // SAFETY: geteuid has no preconditions.
    let me = unsafe { libc::geteuid() };
    if meta.uid() != me {
        return Err(unsafe_dir(format!(
            "belongs to uid {}, not to the daemon's user (uid {me}); remove it or choose another directory",
            meta.uid()
        )));
    }
    let mode = meta.mode() & 0o777;
    if mode & 0o002 != 0 {
        return Err(unsafe_dir(format!(
            "is writable by every user (mode {mode:o}); it must be 0700 (or 0770 with server.runtime_group)"
        )));
    }
    let group_ok = group.is_some_and(|g| g == meta.gid());
    if mode & 0o020 != 0 && !group_ok {
        return Err(unsafe_dir(format!(
            "is writable by its group (gid {}, mode {mode:o}), which is not server.runtime_group",
            meta.gid()
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unsafe_directories_are_refused_with_the_reason() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("run");
        std::fs::create_dir(&dir).unwrap();
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777)).unwrap();
        let e = check(&dir, None).unwrap_err().to_string();
        assert!(
            e.contains("writable by every user") && e.contains("777"),
            "{e}"
        );
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o770)).unwrap();
        let e = check(&dir, None).unwrap_err().to_string();
        assert!(e.contains("writable by its group"), "{e}");
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700)).unwrap();
        check(&dir, None).unwrap();
        let file = dir.join("f");
        std::fs::write(&file, b"").unwrap();
        assert!(check(&file, None)
            .unwrap_err()
            .to_string()
            .contains("not a directory"));
        assert!(matches!(
            group_id("no-such-group-replayd"),
            Err(RuntimeDirError::NoSuchGroup(_))
        ));
    }
}
