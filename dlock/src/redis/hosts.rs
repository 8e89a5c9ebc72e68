//! The URLs that list several hosts (`redis+cluster://`, `redis+sentinel://`, `redlock://`,
//! and their TLS forms `rediss+cluster://`, `rediss+sentinel://`, `rediss+redlock://`):
//! scheme, `user:password@`, the host list `host:port,host:port,...` (IPv6 as `[v6]:port`),
//! path and query. Each URL kind says what its hosts are called, their default port and its example;
//! its path is its own.

use std::fmt;

use crate::LockError;
use crate::options::{percent_decode, shown};

/// One kind of multi-host URL.
pub(crate) struct HostListUrl {
    /// The scheme, in lower case (`redis+cluster`).
    pub(crate) scheme: &'static str,
    /// The scheme of the same URL over TLS (`rediss+cluster`).
    pub(crate) tls_scheme: &'static str,
    /// What the URL leads to, as the wrong-scheme message names it (`Redis Cluster`).
    pub(crate) leads_to: &'static str,
    /// What each host is (`node`).
    pub(crate) noun: &'static str,
    /// The port of a host that names none.
    pub(crate) default_port: u16,
    /// How the URL is written, shown in every error.
    pub(crate) example: &'static str,
}

/// A URL split at its scheme, path and query (each without its `/` or `?`).
pub(crate) struct Split<'a> {
    /// Whether the scheme is the TLS one.
    pub(crate) tls: bool,
    authority: &'a str,
    pub(crate) path: &'a str,
    pub(crate) query: &'a str,
}

/// The credentials and hosts of a URL's authority.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Hosts {
    pub(crate) nodes: Vec<(String, u16)>,
    pub(crate) user: Option<String>,
    pub(crate) password: Option<String>,
}

impl Split<'_> {
    /// The URL's `user:password` as written (still percent-encoded), if it has one.
    pub(crate) fn userinfo(&self) -> Option<&str> {
        self.authority
            .rsplit_once('@')
            .map(|(userinfo, _)| userinfo)
    }
}

impl HostListUrl {
    /// A configuration error that says what is wrong with the URL and how to write it.
    pub(crate) fn error(&self, what: impl fmt::Display) -> LockError {
        LockError::config(format!(
            "the {} URL {what}; write it like {}",
            self.scheme, self.example
        ))
    }

    /// Checks the scheme and splits off the path and the query.
    pub(crate) fn split<'a>(&self, url: &'a str) -> Result<Split<'a>, LockError> {
        let (tls, rest) = url
            .split_once("://")
            .and_then(|(scheme, rest)| {
                if scheme.eq_ignore_ascii_case(self.scheme) {
                    Some((false, rest))
                } else if scheme.eq_ignore_ascii_case(self.tls_scheme) {
                    Some((true, rest))
                } else {
                    None
                }
            })
            .ok_or_else(|| {
                LockError::config(format!(
                    "a {} URL starts with {}:// ({}:// over TLS); write it like {}",
                    self.leads_to, self.scheme, self.tls_scheme, self.example
                ))
            })?;
        let (main, query) = rest.split_once('?').unwrap_or((rest, ""));
        let (authority, path) = match main.find('/') {
            Some(at) => (&main[..at], &main[at + 1..]),
            None => (main, ""),
        };
        Ok(Split {
            tls,
            authority,
            path,
            query,
        })
    }

    /// The user name, password and hosts of `split`'s authority. Errors never repeat the
    /// password.
    pub(crate) fn hosts(&self, split: &Split<'_>) -> Result<Hosts, LockError> {
        let (userinfo, hosts) = match split.authority.rsplit_once('@') {
            Some((userinfo, hosts)) => (Some(userinfo), hosts),
            None => (None, split.authority),
        };
        let (user, password) = match userinfo {
            None => (None, None),
            Some(userinfo) => {
                let (user, password) = match userinfo.split_once(':') {
                    Some((user, password)) => (user, Some(password)),
                    None => (userinfo, None),
                };
                let user = percent_decode(user).ok_or_else(|| {
                    self.error("has a user name that is not percent-encoded UTF-8")
                })?;
                let password = password
                    .map(|p| {
                        percent_decode(p).ok_or_else(|| {
                            self.error("has a password that is not percent-encoded UTF-8")
                        })
                    })
                    .transpose()?;
                ((!user.is_empty()).then_some(user), password)
            }
        };
        let noun = self.noun;
        if hosts.trim().is_empty() {
            return Err(self.error(format_args!("lists no {noun} (host:port,host:port,...)")));
        }
        let mut nodes = Vec::new();
        for host in hosts.split(',').map(str::trim) {
            if host.is_empty() {
                return Err(self.error(format_args!(
                    "lists its {noun}s as host:port,host:port,...; one of them is empty"
                )));
            }
            let node = self.host_port(host)?;
            // Host names are case-insensitive: `a:1` and `A:1` are one server.
            if nodes
                .iter()
                .any(|(h, p): &(String, u16)| h.eq_ignore_ascii_case(&node.0) && *p == node.1)
            {
                return Err(self.error(format_args!("lists the {noun} `{}` twice", shown(host))));
            }
            nodes.push(node);
        }
        Ok(Hosts {
            nodes,
            user,
            password,
        })
    }

    /// `host`, `host:port`, `[v6]` or `[v6]:port`.
    fn host_port(&self, text: &str) -> Result<(String, u16), LockError> {
        let (host, port) = if let Some(rest) = text.strip_prefix('[') {
            let (host, after) = rest.split_once(']').ok_or_else(|| {
                self.error(format_args!("has `{}`: an unclosed `[`", shown(text)))
            })?;
            let port = match after {
                "" => None,
                _ => Some(after.strip_prefix(':').ok_or_else(|| {
                    self.error(format_args!(
                        "has `{}`: a `:port` must follow the `]`",
                        shown(text)
                    ))
                })?),
            };
            (host, port)
        } else {
            match text.rsplit_once(':') {
                Some((host, port)) => (host, Some(port)),
                None => (text, None),
            }
        };
        if host.is_empty() {
            return Err(self.error(format_args!(
                "has a {} without a host (`{}`)",
                self.noun,
                shown(text)
            )));
        }
        let port = match port {
            None => self.default_port,
            Some(port) => port
                .parse::<u16>()
                .ok()
                .filter(|p| *p != 0)
                .ok_or_else(|| {
                    self.error(format_args!(
                        "has the port `{}` for the {} `{}`: a port is a number from 1 to 65535",
                        shown(port),
                        self.noun,
                        shown(host)
                    ))
                })?,
        };
        Ok((host.to_owned(), port))
    }
}

impl Hosts {
    /// `info` with the URL's user name and password, where it has them.
    pub(crate) fn credentials(
        &self,
        mut info: redis::RedisConnectionInfo,
    ) -> redis::RedisConnectionInfo {
        if let Some(user) = &self.user {
            info = info.set_username(user);
        }
        if let Some(password) = &self.password {
            info = info.set_password(password);
        }
        info
    }
}

/// The configuration error `split` answers for `url`, which must not repeat the password
/// `hunter2` the tests put in URLs.
#[cfg(test)]
pub(crate) fn config_error<T: fmt::Debug>(
    url: &str,
    split: impl Fn(&str) -> Result<T, LockError>,
) -> String {
    let err = split(url).expect_err(url);
    assert_eq!(err.code(), "DistributedLock.Configuration", "{url}: {err}");
    assert!(!err.to_string().contains("hunter2"), "{err}");
    err.to_string()
}

#[cfg(test)]
mod tests {
    use super::super::cluster::{self, DEFAULT_PORT};
    use super::super::sentinel::{self, DEFAULT_SENTINEL_PORT};

    /// Both URL kinds read the same host list, each with its own default port.
    #[test]
    fn host_lists() {
        let cluster = cluster::split_url("redis+cluster://a:1,b,[::1]:3").unwrap();
        let sentinel = sentinel::split_url("redis+sentinel://a:1,b,[::1]:3/mymaster").unwrap();
        for (hosts, default) in [
            (cluster.hosts, DEFAULT_PORT),
            (sentinel.hosts, DEFAULT_SENTINEL_PORT),
        ] {
            let nodes = [
                ("a".to_owned(), 1),
                ("b".to_owned(), default),
                ("::1".to_owned(), 3),
            ];
            assert_eq!(hosts.nodes, nodes);
            assert_eq!((hosts.user, hosts.password), (None, None));
        }
    }
}
