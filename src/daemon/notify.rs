//! systemd notification (`Type=notify`): `READY=1` once every graph is
//! captured, `STOPPING=1` when draining starts. A no-op outside systemd.

/// Sends `state` to `$NOTIFY_SOCKET`, if set.
pub fn notify(state: &str) {
    let Some(path) = std::env::var_os("NOTIFY_SOCKET") else {
        return;
    };
    let Ok(sock) = std::os::unix::net::UnixDatagram::unbound() else {
        return;
    };
    let path = path.to_string_lossy().into_owned();
    let result = if let Some(abstract_name) = path.strip_prefix('@') {
        use std::os::linux::net::SocketAddrExt;
        std::os::unix::net::SocketAddr::from_abstract_name(abstract_name.as_bytes())
            .and_then(|addr| sock.send_to_addr(state.as_bytes(), &addr))
    } else {
        sock.send_to(state.as_bytes(), &path)
    };
    if let Err(e) = result {
        tracing::warn!("sd_notify({state}) to {path}: {e}");
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn sends_to_the_notify_socket() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("notify");
        let listener = std::os::unix::net::UnixDatagram::bind(&path).unwrap();
        // SAFETY: single-threaded use of the variable inside this test.
        unsafe { std::env::set_var("NOTIFY_SOCKET", &path) };
        super::notify("READY=1");
        unsafe { std::env::remove_var("NOTIFY_SOCKET") };
        let mut buf = [0u8; 64];
        let n = listener.recv(&mut buf).unwrap();
        assert_eq!(&buf[..n], b"READY=1");
    }
}
