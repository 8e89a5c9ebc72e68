//! A loopback TCP proxy that counts the requests a client sends to a PostgreSQL or MySQL
//! server (its round trips), by reading the client's side of the wire protocol. Tests put a
//! backend behind it to pin how many round trips an operation costs. The client must not use
//! TLS through it (`sslmode=disable`, `ssl-mode=DISABLED`).

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// Which protocol the proxy reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Protocol {
    /// PostgreSQL's: a round trip ends with a `Sync` (extended protocol) or is one `Query`
    /// (simple protocol).
    Postgres,
    /// MySQL's: a round trip is one command packet (sequence id 0) that the server answers
    /// (not `COM_STMT_CLOSE`, which it does not).
    MySql,
}

/// A running proxy: where to connect, and the requests counted so far on all its
/// connections.
pub struct Proxy {
    pub addr: SocketAddr,
    requests: Arc<AtomicU64>,
}

impl Proxy {
    /// Starts a proxy to `target` on a free loopback port.
    pub async fn start(target: SocketAddr, protocol: Protocol) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("local addr");
        let requests = Arc::new(AtomicU64::new(0));
        let counted = Arc::clone(&requests);
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let counted = Arc::clone(&counted);
                tokio::spawn(async move {
                    let Ok(server) = TcpStream::connect(target).await else {
                        return;
                    };
                    let _ = client.set_nodelay(true);
                    let _ = server.set_nodelay(true);
                    let (mut client_read, mut client_write) = client.into_split();
                    let (mut server_read, mut server_write) = server.into_split();
                    let down = tokio::spawn(async move {
                        let _ = tokio::io::copy(&mut server_read, &mut client_write).await;
                        let _ = client_write.shutdown().await;
                    });
                    let mut reader = Reader::new(protocol);
                    let mut buf = vec![0u8; 64 * 1024];
                    loop {
                        let n = match client_read.read(&mut buf).await {
                            Ok(0) | Err(_) => break,
                            Ok(n) => n,
                        };
                        let got = buf.get(..n).unwrap_or_default();
                        counted.fetch_add(reader.feed(got), Ordering::SeqCst);
                        if server_write.write_all(got).await.is_err() {
                            break;
                        }
                    }
                    let _ = server_write.shutdown().await;
                    let _ = down.await;
                });
            }
        });
        Proxy { addr, requests }
    }

    /// The requests counted so far.
    pub fn requests(&self) -> u64 {
        self.requests.load(Ordering::SeqCst)
    }
}

/// Reads the client's byte stream into messages and counts the requests among them.
struct Reader {
    protocol: Protocol,
    pending: Vec<u8>,
    /// PostgreSQL: still in the startup phase (messages without a type byte).
    startup: bool,
}

impl Reader {
    fn new(protocol: Protocol) -> Self {
        Reader {
            protocol,
            pending: Vec::new(),
            startup: true,
        }
    }

    /// Takes more bytes; the requests completed by them.
    fn feed(&mut self, bytes: &[u8]) -> u64 {
        self.pending.extend_from_slice(bytes);
        let mut counted = 0;
        while let Some((size, request)) = self.next_message() {
            self.pending.drain(..size);
            counted += u64::from(request);
        }
        counted
    }

    /// The size of the next complete message, and whether it is a request.
    fn next_message(&mut self) -> Option<(usize, bool)> {
        match self.protocol {
            Protocol::Postgres if self.startup => {
                let len = be_u32(self.pending.get(..4)?) as usize;
                let code = be_u32(self.pending.get(4..8)?);
                if self.pending.len() < len {
                    return None;
                }
                // SSLRequest and GSSENCRequest are answered with one byte, and the startup
                // message follows; the startup message (protocol 3.0) ends the phase.
                if code == 196_608 {
                    self.startup = false;
                }
                Some((len, false))
            }
            Protocol::Postgres => {
                let kind = *self.pending.first()?;
                let len = be_u32(self.pending.get(1..5)?) as usize;
                if self.pending.len() < len + 1 {
                    return None;
                }
                Some((len + 1, matches!(kind, b'S' | b'Q')))
            }
            Protocol::MySql => {
                let header = self.pending.get(..4)?;
                let len = usize::from(header[0])
                    | usize::from(header[1]) << 8
                    | usize::from(header[2]) << 16;
                let sequence = header[3];
                if self.pending.len() < len + 4 {
                    return None;
                }
                // COM_QUERY, COM_PING, COM_STMT_PREPARE, COM_STMT_EXECUTE, COM_RESET_CONNECTION.
                let command = self.pending.get(4).copied();
                let request =
                    sequence == 0 && matches!(command, Some(0x03 | 0x0e | 0x16 | 0x17 | 0x1f));
                Some((len + 4, request))
            }
        }
    }
}

fn be_u32(bytes: &[u8]) -> u32 {
    u32::from_be_bytes([bytes[0], bytes[1], bytes[2], bytes[3]])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn postgres_messages_are_counted_by_sync() {
        let mut reader = Reader::new(Protocol::Postgres);
        let mut wire = Vec::new();
        // SSLRequest, then the startup message.
        wire.extend_from_slice(&8u32.to_be_bytes());
        wire.extend_from_slice(&80_877_103u32.to_be_bytes());
        wire.extend_from_slice(&9u32.to_be_bytes());
        wire.extend_from_slice(&196_608u32.to_be_bytes());
        wire.push(0);
        // Bind, Execute, Sync.
        for kind in [b'B', b'E', b'S'] {
            wire.push(kind);
            wire.extend_from_slice(&4u32.to_be_bytes());
        }
        let (first, rest) = wire.split_at(11);
        assert_eq!(reader.feed(first), 0);
        assert_eq!(reader.feed(rest), 1);
    }
}
