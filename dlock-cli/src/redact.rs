//! Lock store URLs as messages show them: without a password.

/// `url` with the password of its user information (`user:password@`) replaced by `***`, and
/// the values of query options whose name says they are secret (`...password`, `...token`,
/// `...secret`) likewise. Works on URLs with several hosts (`redis+cluster://a:1,b:2`), which
/// URL parsers refuse.
pub fn redact(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        // Not a URL dlock knows: nothing in it is shown.
        return "(a URL without a scheme, not shown)".to_owned();
    };
    let end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(end);
    let authority = match authority.rsplit_once('@') {
        Some((userinfo, hosts)) => match userinfo.split_once(':') {
            Some((user, _password)) => format!("{user}:***@{hosts}"),
            None => format!("{userinfo}@{hosts}"),
        },
        None => authority.to_owned(),
    };
    let tail = match tail.split_once('?') {
        Some((path, query)) => {
            let (query, fragment) = match query.split_once('#') {
                Some((query, fragment)) => (query, Some(fragment)),
                None => (query, None),
            };
            let options: Vec<String> = query
                .split('&')
                .map(|option| match option.split_once('=') {
                    Some((name, _)) if is_secret(name) => format!("{name}=***"),
                    _ => option.to_owned(),
                })
                .collect();
            let mut tail = format!("{path}?{}", options.join("&"));
            if let Some(fragment) = fragment {
                tail.push('#');
                tail.push_str(fragment);
            }
            tail
        }
        None => tail.to_owned(),
    };
    format!("{scheme}://{authority}{tail}")
}

fn is_secret(name: &str) -> bool {
    let name = name.to_ascii_lowercase();
    ["password", "passwd", "secret", "token"]
        .iter()
        .any(|secret| name.contains(secret))
}

#[cfg(test)]
mod tests {
    use super::redact;

    #[test]
    fn passwords_are_not_shown() {
        let cases = [
            ("redis://:s3cret@host:6379/0", "redis://:***@host:6379/0"),
            (
                "postgres://app:s3cret@db:5432/app?sslmode=require",
                "postgres://app:***@db:5432/app?sslmode=require",
            ),
            ("postgres://app@db/app", "postgres://app@db/app"),
            (
                "redis+cluster://u:p%40ss@a:1,b:2?timeout=2s",
                "redis+cluster://u:***@a:1,b:2?timeout=2s",
            ),
            (
                "redis+sentinel://a:1,b:2/mymaster?sentinel_password=x&lease=5s",
                "redis+sentinel://a:1,b:2/mymaster?sentinel_password=***&lease=5s",
            ),
            (
                "sqlite:///var/lib/app/locks.db?lease=10s",
                "sqlite:///var/lib/app/locks.db?lease=10s",
            ),
            (
                "etcd://root:pw@127.0.0.1:2379",
                "etcd://root:***@127.0.0.1:2379",
            ),
            ("mssql://sa:p@ss:w@host/db", "mssql://sa:***@host/db"),
            (
                "postgres://h/db?sslpassword=x&key_layout=y",
                "postgres://h/db?sslpassword=***&key_layout=y",
            ),
        ];
        for (url, shown) in cases {
            assert_eq!(redact(url), shown, "{url}");
        }
        assert!(!redact("locks.db:secret").contains("secret"));
    }
}
