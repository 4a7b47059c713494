//! A scripted HTTP upstream on a local socket: answers each request by its method and path
//! (or hangs up), and remembers what it was sent.

use std::sync::{Arc, Mutex};

use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::TcpListener,
};

/// What the scripted upstream does with one request.
#[derive(Clone, Copy)]
pub(crate) enum Answer {
    /// Answers with this status and body.
    Status(u16, &'static str),
    /// Answers with this status, content type and body.
    Typed(u16, &'static str, &'static str),
    /// Reads the request whole, then closes the connection without a word.
    Hangup,
    /// Answers with this redirect status, pointing at this path.
    Redirect(u16, &'static str),
    /// Answers 200 with this content type, declaring a body longer than the one it sends,
    /// then closes the connection: an answer cut off mid-stream.
    CutOff(&'static str, &'static str),
}

/// The upstream: answers each request by its method and path, and remembers them.
pub(crate) struct Upstream {
    pub(crate) base_url: String,
    /// Each request as `METHOD path`, with its body.
    seen: Arc<Mutex<Vec<(String, String)>>>,
}

impl Upstream {
    pub(crate) async fn start(script: fn(&str, &str) -> Answer) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base_url = format!("http://{}", listener.local_addr().unwrap());
        let seen = Arc::new(Mutex::new(Vec::new()));
        let log = seen.clone();
        tokio::spawn(async move {
            while let Ok((mut socket, _)) = listener.accept().await {
                let log = log.clone();
                tokio::spawn(async move {
                    let Some((method, path, body)) = read_request(&mut socket).await else {
                        return;
                    };
                    log.lock().unwrap().push((format!("{method} {path}"), body));
                    let response = match script(&method, &path) {
                        Answer::Status(status, body) => format!(
                            "HTTP/1.1 {status} X\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                            body.len()
                        ),
                        Answer::Typed(status, content_type, body) => format!(
                            "HTTP/1.1 {status} X\r\ncontent-type: {content_type}\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                            body.len()
                        ),
                        Answer::Redirect(status, to) => format!(
                            "HTTP/1.1 {status} X\r\nlocation: {to}\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
                        ),
                        Answer::CutOff(content_type, body) => format!(
                            "HTTP/1.1 200 OK\r\ncontent-type: {content_type}\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                            body.len() + 100
                        ),
                        Answer::Hangup => return,
                    };
                    let _ = socket.write_all(response.as_bytes()).await;
                });
            }
        });
        Self { base_url, seen }
    }

    pub(crate) fn seen(&self, request: &str) -> usize {
        self.seen
            .lock()
            .unwrap()
            .iter()
            .filter(|(r, _)| r.starts_with(request))
            .count()
    }

    /// The bodies of the requests that start with `request` (`METHOD path`), in order.
    pub(crate) fn bodies(&self, request: &str) -> Vec<String> {
        self.seen
            .lock()
            .unwrap()
            .iter()
            .filter(|(r, _)| r.starts_with(request))
            .map(|(_, body)| body.clone())
            .collect()
    }
}

/// The method, path and body of one HTTP/1.1 request.
async fn read_request(socket: &mut tokio::net::TcpStream) -> Option<(String, String, String)> {
    let mut data = Vec::new();
    let mut buf = [0u8; 4096];
    let head_end = loop {
        let n = socket.read(&mut buf).await.ok()?;
        if n == 0 {
            return None;
        }
        data.extend_from_slice(&buf[..n]);
        if let Some(at) = data.windows(4).position(|w| w == b"\r\n\r\n") {
            break at + 4;
        }
    };
    let head = String::from_utf8_lossy(&data[..head_end]).to_string();
    let length: usize = head
        .lines()
        .find_map(|l| {
            let (name, value) = l.split_once(':')?;
            name.eq_ignore_ascii_case("content-length")
                .then(|| value.trim().parse().ok())?
        })
        .unwrap_or(0);
    while data.len() < head_end + length {
        let n = socket.read(&mut buf).await.ok()?;
        if n == 0 {
            return None;
        }
        data.extend_from_slice(&buf[..n]);
    }
    let mut words = head.split_whitespace();
    let method = words.next()?.to_owned();
    let path = words.next()?.to_owned();
    let body = String::from_utf8_lossy(&data[head_end..head_end + length]).into_owned();
    Some((method, path, body))
}
