//! Lock key templates such as `"account:{account_id}"`, and the encoding of the values put
//! into them.
//!
//! The attribute macro and the axum layer build keys from a template and values that come
//! from arguments, struct fields or path parameters. Both use this module, so one template
//! gives the same key wherever it is rendered.
//!
//! # Template syntax
//!
//! | in the template | means |
//! |---|---|
//! | `{name}` or `<name>` | the value of `name`, [encoded](encode_component) |
//! | `{{` `}}` `<<` `>>` | a literal `{` `}` `<` `>` |
//! | anything else | itself |
//!
//! A name is one or more ASCII letters, digits, `_` or `.` (`{cmd.account_id}` lets the macro
//! reach into a parameter). A lone `}` or `>`, an unclosed placeholder or an empty name is an
//! error, so a typo never silently becomes part of every key.
//!
//! # Why values are encoded
//!
//! Without encoding, `"{a}:{b}"` renders `a = "x:y", b = "z"` and `a = "x", b = "y:z"` to the
//! same key `x:y:z`, and two requests that should not exclude each other would. Encoding `:`,
//! `%`, the brace and angle characters and control characters in values (as `%XX`, uppercase,
//! of their UTF-8 bytes) makes the rendering injective: distinct values always give distinct
//! keys.
//!
//! ```
//! use dlock::key_template::KeyTemplate;
//!
//! let template = KeyTemplate::parse("account:{account_id}").unwrap();
//! let key = template
//!     .render(|name| (name == "account_id").then_some("42:7"))
//!     .unwrap();
//! assert_eq!(key, "account:42%3A7");
//! ```

use std::borrow::Cow;
use std::fmt;

/// Percent-encodes the characters of a template value that could make two distinct values
/// render to the same key: `:` `%` `{` `}` `<` `>` and control characters (`char::is_control`:
/// U+0000–U+001F, U+007F–U+009F), each as `%XX` (uppercase hex) of its UTF-8 bytes.
///
/// Everything else, including non-ASCII letters, is kept as is. Returns the value borrowed
/// when nothing needs encoding, so the common case does not allocate.
///
/// ```
/// use dlock::key_template::encode_component;
///
/// assert_eq!(encode_component("42"), "42");
/// assert_eq!(encode_component("a:b%c"), "a%3Ab%25c");
/// assert_eq!(encode_component("{x}<y>"), "%7Bx%7D%3Cy%3E");
/// assert_eq!(encode_component("line\nbreak\u{85}"), "line%0Abreak%C2%85");
/// assert_eq!(encode_component("ключ/ü"), "ключ/ü");
/// ```
pub fn encode_component(value: &str) -> Cow<'_, str> {
    let Some(first) = value.find(needs_encoding) else {
        return Cow::Borrowed(value);
    };
    let mut out = String::with_capacity(value.len() + 8);
    out.push_str(&value[..first]);
    for c in value[first..].chars() {
        if needs_encoding(c) {
            let mut buf = [0u8; 4];
            for byte in c.encode_utf8(&mut buf).bytes() {
                push_escaped(&mut out, byte);
            }
        } else {
            out.push(c);
        }
    }
    Cow::Owned(out)
}

fn needs_encoding(c: char) -> bool {
    matches!(c, ':' | '%' | '{' | '}' | '<' | '>') || c.is_control()
}

fn push_escaped(out: &mut String, byte: u8) {
    const HEX: &[u8; 16] = b"0123456789ABCDEF";
    out.push('%');
    out.push(char::from(HEX[usize::from(byte >> 4)]));
    out.push(char::from(HEX[usize::from(byte & 0x0F)]));
}

/// A parsed lock key template such as `"account:{account_id}"`.
///
/// See the [module documentation](self) for the syntax. Parse once, render per call.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KeyTemplate {
    source: String,
    segments: Vec<Segment>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum Segment {
    Literal(String),
    Placeholder(String),
}

/// What is wrong with a key template, or why it could not be rendered.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum TemplateError {
    /// A `{` or `<` at byte `position` has no matching `}` or `>`.
    Unclosed {
        /// Byte offset of the opening character.
        position: usize,
    },
    /// A `}` or `>` at byte `position` closes nothing (write `}}` or `>>` for the character).
    Unopened {
        /// Byte offset of the character.
        position: usize,
    },
    /// The placeholder at byte `position` has an empty name or characters other than ASCII
    /// letters, digits, `_` and `.`.
    BadName {
        /// Byte offset of the opening character.
        position: usize,
        /// The name as written.
        name: String,
    },
    /// [`KeyTemplate::render`] found no value for this placeholder.
    Missing {
        /// The placeholder's name.
        name: String,
    },
}

impl fmt::Display for TemplateError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TemplateError::Unclosed { position } => write!(
                f,
                "the placeholder opened at byte {position} is not closed \
                 (write `{{{{` or `<<` for a literal `{{` or `<`)"
            ),
            TemplateError::Unopened { position } => write!(
                f,
                "the `}}` or `>` at byte {position} closes nothing \
                 (write `}}}}` or `>>` for a literal `}}` or `>`)"
            ),
            TemplateError::BadName { position, name } => write!(
                f,
                "the placeholder at byte {position} has the name `{}`; a name is one or more \
                 ASCII letters, digits, `_` or `.`",
                name.escape_debug()
            ),
            TemplateError::Missing { name } => {
                write!(f, "no value for the placeholder `{}`", name.escape_debug())
            }
        }
    }
}

impl std::error::Error for TemplateError {}

impl From<TemplateError> for crate::LockError {
    fn from(err: TemplateError) -> Self {
        crate::LockError::config(format!("lock key template: {err}"))
    }
}

impl KeyTemplate {
    /// Parses `template`.
    ///
    /// ```
    /// use dlock::key_template::{KeyTemplate, TemplateError};
    ///
    /// let t = KeyTemplate::parse("{{literal}}:<id>:{tenant.id}").unwrap();
    /// assert_eq!(t.placeholders().collect::<Vec<_>>(), ["id", "tenant.id"]);
    /// assert_eq!(
    ///     KeyTemplate::parse("account:{id"),
    ///     Err(TemplateError::Unclosed { position: 8 })
    /// );
    /// ```
    pub fn parse(template: &str) -> Result<KeyTemplate, TemplateError> {
        let mut segments = Vec::new();
        let mut literal = String::new();
        let mut chars = template.char_indices().peekable();
        while let Some((position, c)) = chars.next() {
            match c {
                '{' | '<' | '}' | '>' if chars.peek().map(|&(_, next)| next) == Some(c) => {
                    chars.next();
                    literal.push(c);
                }
                '{' | '<' => {
                    let close = if c == '{' { '}' } else { '>' };
                    let start = position + 1;
                    let Some(len) = template[start..].find(close) else {
                        return Err(TemplateError::Unclosed { position });
                    };
                    let name = &template[start..start + len];
                    if name.is_empty()
                        || !name
                            .chars()
                            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '.')
                    {
                        return Err(TemplateError::BadName {
                            position,
                            name: name.to_owned(),
                        });
                    }
                    // Skip the name and the closing character.
                    while chars.next_if(|&(i, _)| i <= start + len).is_some() {}
                    if !literal.is_empty() {
                        segments.push(Segment::Literal(std::mem::take(&mut literal)));
                    }
                    segments.push(Segment::Placeholder(name.to_owned()));
                }
                '}' | '>' => return Err(TemplateError::Unopened { position }),
                _ => literal.push(c),
            }
        }
        if !literal.is_empty() {
            segments.push(Segment::Literal(literal));
        }
        Ok(KeyTemplate {
            source: template.to_owned(),
            segments,
        })
    }

    /// The template as written.
    pub fn as_str(&self) -> &str {
        &self.source
    }

    /// The placeholder names, in order of appearance (repeated names appear repeatedly).
    pub fn placeholders(&self) -> impl Iterator<Item = &str> + '_ {
        self.segments.iter().filter_map(|segment| match segment {
            Segment::Placeholder(name) => Some(name.as_str()),
            Segment::Literal(_) => None,
        })
    }

    /// Renders the key: each placeholder becomes `value(name)`, passed through
    /// [`encode_component`]; literals are copied as written (after unescaping `{{` and the
    /// like). Fails with [`TemplateError::Missing`] when `value` returns `None`.
    ///
    /// ```
    /// use dlock::key_template::KeyTemplate;
    ///
    /// let t = KeyTemplate::parse("transfer:{from}->>{to}").unwrap();
    /// let key = t.render(|name| match name {
    ///     "from" => Some("a"),
    ///     "to" => Some("b:c"),
    ///     _ => None,
    /// });
    /// assert_eq!(key.unwrap(), "transfer:a->b%3Ac");
    /// ```
    pub fn render<F, V>(&self, mut value: F) -> Result<String, TemplateError>
    where
        F: FnMut(&str) -> Option<V>,
        V: AsRef<str>,
    {
        let mut key = String::with_capacity(self.source.len() + 16);
        for segment in &self.segments {
            match segment {
                Segment::Literal(text) => key.push_str(text),
                Segment::Placeholder(name) => {
                    let Some(v) = value(name) else {
                        return Err(TemplateError::Missing { name: name.clone() });
                    };
                    key.push_str(&encode_component(v.as_ref()));
                }
            }
        }
        Ok(key)
    }
}

impl fmt::Display for KeyTemplate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.source)
    }
}

impl std::str::FromStr for KeyTemplate {
    type Err = TemplateError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        KeyTemplate::parse(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn render(template: &str, pairs: &[(&str, &str)]) -> Result<String, TemplateError> {
        KeyTemplate::parse(template)?.render(|name| {
            pairs
                .iter()
                .find(|(n, _)| *n == name)
                .map(|(_, value)| *value)
        })
    }

    #[test]
    fn encoding_keeps_plain_values_borrowed() {
        assert!(matches!(encode_component("plain-42_ü"), Cow::Borrowed(_)));
        assert!(matches!(encode_component(""), Cow::Borrowed(_)));
        assert!(matches!(encode_component("a:b"), Cow::Owned(_)));
    }

    #[test]
    fn encoding_covers_separators_and_controls() {
        assert_eq!(encode_component(":%{}<>"), "%3A%25%7B%7D%3C%3E");
        assert_eq!(encode_component("\0\t\r\n\u{7f}"), "%00%09%0D%0A%7F");
        assert_eq!(encode_component("\u{9f}"), "%C2%9F");
        assert_eq!(encode_component("ok/ok?x=1&y"), "ok/ok?x=1&y");
        // An already encoded value is encoded again, so it stays distinct from its decoding.
        assert_eq!(encode_component("%3A"), "%253A");
    }

    #[test]
    fn distinct_values_give_distinct_keys() {
        let values = [
            "x", "x:y", "y", "y:z", "z", ":", "%3A", "%", "", "{y}", "<y>",
        ];
        let mut seen = std::collections::HashSet::new();
        for a in values {
            for b in values {
                let key = render("{a}:{b}", &[("a", a), ("b", b)]).unwrap();
                assert!(seen.insert(key.clone()), "{a:?} {b:?} collided on {key:?}");
            }
        }
    }

    #[test]
    fn parses_both_spellings_and_escapes() {
        assert_eq!(
            render("account:{id}", &[("id", "42")]).unwrap(),
            "account:42"
        );
        assert_eq!(
            render("account:<id>", &[("id", "42")]).unwrap(),
            "account:42"
        );
        assert_eq!(
            render("{{{id}}}<<<id>>>", &[("id", "7")]).unwrap(),
            "{7}<7>"
        );
        assert_eq!(render("{a}{b}", &[("a", "1"), ("b", "2")]).unwrap(), "12");
        assert_eq!(
            render("{cmd.account_id}", &[("cmd.account_id", "9")]).unwrap(),
            "9"
        );
        assert_eq!(render("static", &[]).unwrap(), "static");
        assert_eq!(render("ü:{k}:鍵", &[("k", "ключ")]).unwrap(), "ü:ключ:鍵");
    }

    #[test]
    fn rejects_malformed_templates() {
        assert_eq!(
            KeyTemplate::parse("a{b"),
            Err(TemplateError::Unclosed { position: 1 })
        );
        assert_eq!(
            KeyTemplate::parse("a<b"),
            Err(TemplateError::Unclosed { position: 1 })
        );
        assert_eq!(
            KeyTemplate::parse("a}b"),
            Err(TemplateError::Unopened { position: 1 })
        );
        assert_eq!(
            KeyTemplate::parse("x->y"),
            Err(TemplateError::Unopened { position: 2 })
        );
        assert!(matches!(
            KeyTemplate::parse("{}"),
            Err(TemplateError::BadName { position: 0, .. })
        ));
        assert!(matches!(
            KeyTemplate::parse("{a b}"),
            Err(TemplateError::BadName { .. })
        ));
        // `{a>` is an unclosed `{`, not a `{` closed by `>`.
        assert!(KeyTemplate::parse("{a>").is_err());
    }

    #[test]
    fn missing_value_is_an_error() {
        assert_eq!(
            render("account:{id}", &[]),
            Err(TemplateError::Missing { name: "id".into() })
        );
        let err = crate::LockError::from(TemplateError::Missing { name: "id".into() });
        assert_eq!(err.code(), "DistributedLock.Configuration");
    }

    #[test]
    fn lists_placeholders_and_round_trips() {
        let t: KeyTemplate = "a:{x}:<y>:{x}".parse().unwrap();
        assert_eq!(t.placeholders().collect::<Vec<_>>(), ["x", "y", "x"]);
        assert_eq!(t.to_string(), "a:{x}:<y>:{x}");
        assert_eq!(t.as_str(), "a:{x}:<y>:{x}");
    }
}
