//! Google's batch HTTP framing (`POST /batch/gmail/v1`, multipart/mixed with one embedded HTTP
//! request per part, answered by one embedded HTTP response per part). Written by hand: no
//! maintained crate speaks it, and the format is small and documented
//! (developers.google.com/gmail/api/guides/batch).

use std::collections::HashMap;

/// Google advises at most 50 requests per batch (the hard limit is 100).
pub const MAX_PER_BATCH: usize = 50;

/// The body and content type of a batch of GET requests, part `i` with Content-ID `<item-i>`.
pub fn encode(paths: &[String], boundary: &str) -> (String, String) {
    let mut body = String::new();
    for (i, path) in paths.iter().enumerate() {
        body.push_str(&format!(
            "--{boundary}\r\nContent-Type: application/http\r\nContent-ID: <item-{i}>\r\n\r\nGET {path}\r\n\r\n"
        ));
    }
    body.push_str(&format!("--{boundary}--\r\n"));
    (body, format!("multipart/mixed; boundary={boundary}"))
}

/// One embedded response.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PartResponse {
    pub status: u16,
    pub body: String,
    /// Its own `Retry-After` (seconds or an HTTP date), when it has a readable one.
    pub retry_after: Option<std::time::Duration>,
}

/// Parses a batch response into the embedded responses by request index (from Content-ID
/// `<response-item-i>`). Parts that cannot be read are left out; callers treat a missing index
/// as a failed part.
pub fn decode(content_type: &str, body: &str) -> Result<HashMap<usize, PartResponse>, String> {
    let boundary = content_type
        .split(';')
        .map(str::trim)
        .find_map(|p| p.strip_prefix("boundary="))
        .map(|b| b.trim_matches('"'))
        .ok_or_else(|| {
            format!("the batch response has no boundary (content type {content_type:?})")
        })?;
    let delimiter = format!("--{boundary}");
    let mut out = HashMap::new();
    for part in body.split(delimiter.as_str()).skip(1) {
        if part.starts_with("--") {
            break;
        }
        let Some((headers, rest)) = split_blank_line(part.trim_start_matches(['\r', '\n'])) else {
            continue;
        };
        let index = headers.lines().find_map(|l| {
            let (name, value) = l.split_once(':')?;
            if !name.trim().eq_ignore_ascii_case("content-id") {
                return None;
            }
            let v = value.trim().trim_start_matches('<').trim_end_matches('>');
            v.strip_prefix("response-item-")
                .or_else(|| v.strip_prefix("response-"))
                .and_then(|n| n.parse().ok())
        });
        let Some(index) = index else { continue };
        let Some((http_head, http_body)) = split_blank_line(rest) else {
            continue;
        };
        let status = http_head
            .lines()
            .next()
            .and_then(|line| line.split_whitespace().nth(1))
            .and_then(|code| code.parse().ok());
        let retry_after = http_head.lines().skip(1).find_map(|l| {
            let (name, value) = l.split_once(':')?;
            name.trim()
                .eq_ignore_ascii_case("retry-after")
                .then(|| svc_kit::retry_after::parse(value))?
        });
        if let Some(status) = status {
            out.insert(
                index,
                PartResponse {
                    status,
                    body: http_body.trim_end().to_owned(),
                    retry_after,
                },
            );
        }
    }
    Ok(out)
}

fn split_blank_line(s: &str) -> Option<(&str, &str)> {
    s.split_once("\r\n\r\n").or_else(|| s.split_once("\n\n"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_are_framed_one_part_each() {
        let (body, ct) = encode(
            &["/gmail/v1/users/me/messages/a?format=metadata".into()],
            "b1",
        );
        assert_eq!(ct, "multipart/mixed; boundary=b1");
        assert!(body.starts_with(
            "--b1\r\nContent-Type: application/http\r\nContent-ID: <item-0>\r\n\r\nGET /gmail"
        ));
        assert!(body.ends_with("--b1--\r\n"));
    }

    #[test]
    fn responses_are_mapped_back_by_content_id_and_a_failed_part_stands_alone() {
        let body = "--batch_x\r\nContent-Type: application/http\r\nContent-ID: <response-item-1>\r\n\r\n\
HTTP/1.1 429 Too Many Requests\r\nRetry-After: 17\r\nContent-Type: application/json\r\n\r\n{\"error\":{}}\r\n\
--batch_x\r\nContent-Type: application/http\r\nContent-ID: <response-item-0>\r\n\r\n\
HTTP/1.1 200 OK\r\nContent-Type: application/json; charset=UTF-8\r\n\r\n{\"id\":\"a\"}\r\n--batch_x--\r\n";
        let parts = decode("multipart/mixed; boundary=batch_x", body).unwrap();
        assert_eq!(
            parts[&0],
            PartResponse {
                status: 200,
                body: "{\"id\":\"a\"}".into(),
                retry_after: None,
            }
        );
        assert_eq!(parts[&1].status, 429);
        assert_eq!(
            parts[&1].retry_after,
            Some(std::time::Duration::from_secs(17))
        );
    }

    #[test]
    fn garbage_never_panics() {
        assert!(decode("text/plain", "nonsense").is_err());
        assert!(
            decode("multipart/mixed; boundary=z", "--z\r\n\r\n--z--")
                .unwrap()
                .is_empty()
        );
    }
}
