//! Parsing: the attribute's arguments and the key template.

use proc_macro2::{Span, TokenStream};
use quote::{ToTokens, quote};
use syn::ext::IdentExt;
use syn::parse::{Parse, ParseStream};
use syn::spanned::Spanned;
use syn::{Expr, ExprLit, ExprUnary, Ident, Lit, LitStr, Token, UnOp};

mod kw {
    syn::custom_keyword!(timeout);
    syn::custom_keyword!(provider);
    syn::custom_keyword!(guard);
    syn::custom_keyword!(on_lost);
    syn::custom_keyword!(keys);
    syn::custom_keyword!(permits);
    syn::custom_keyword!(mode);
}

/// The options, as listed in error messages.
const OPTIONS: &str = "`timeout = <seconds or \"duration\">`, `provider = <expr>`, `guard = <name>`, \
                       `on_lost = cancel | finish`, `permits = <n>` and `mode = read | write`";

/// An example of `keys(...)`, for error messages.
const KEYS_EXAMPLE: &str = "keys(\"account:{from}\", \"account:{to}\")";

/// What the function does when its lock is lost while the body runs (`on_lost = ...`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum OnLost {
    /// Stop the body at once and return `Err(Lost)`.
    Cancel,
    /// Run the body to its end, then return `Err(Lost)` (the default).
    Finish,
}

impl OnLost {
    fn parse(input: ParseStream<'_>) -> syn::Result<Self> {
        const HELP: &str = "`on_lost` is `cancel` (stop the body as soon as the lock is lost, \
                            and return `Err(Lost)`) or `finish` (the default: run the body to \
                            its end, then return `Err(Lost)`)";
        if !input.peek(Ident::peek_any) {
            return Err(syn::Error::new(input.span(), HELP));
        }
        let value = input.call(Ident::parse_any)?;
        match value.to_string().as_str() {
            "cancel" => Ok(OnLost::Cancel),
            "finish" => Ok(OnLost::Finish),
            other => Err(syn::Error::new(
                value.span(),
                format!("unknown `on_lost` value `{other}`; {HELP}"),
            )),
        }
    }
}

/// Whether the lock is shared with other readers (`mode = read`) or exclusive (`mode = write`,
/// the default).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Mode {
    /// A read lock, shared with other readers of the key.
    Read,
    /// An exclusive lock (the default).
    Write,
}

impl Mode {
    fn parse(input: ParseStream<'_>) -> syn::Result<Self> {
        const HELP: &str = "`mode` is `read` (a read lock, shared with other readers of the \
                            key and excluded by writers) or `write` (the default: an exclusive \
                            lock)";
        if !input.peek(Ident::peek_any) {
            return Err(syn::Error::new(input.span(), HELP));
        }
        let value = input.call(Ident::parse_any)?;
        match value.to_string().as_str() {
            "read" => Ok(Mode::Read),
            "write" => Ok(Mode::Write),
            other => Err(syn::Error::new(
                value.span(),
                format!("unknown `mode` value `{other}`; {HELP}"),
            )),
        }
    }
}

/// What the attribute locks: one key template, or several in `keys(...)`.
pub(crate) enum Keys {
    /// `"account:{id}"`: one key.
    One(Template),
    /// `keys("account:{from}", "account:{to}")`: two or more keys, taken all or none.
    Many(kw::keys, Vec<Template>),
}

impl Keys {
    fn parse(input: ParseStream<'_>) -> syn::Result<Self> {
        if input.peek(kw::keys) {
            let keyword: kw::keys = input.parse()?;
            let content;
            let parens = syn::parenthesized!(content in input);
            let lits = content
                .parse_terminated(|input| input.parse::<LitStr>(), Token![,])
                .map_err(|err| {
                    syn::Error::new(
                        err.span(),
                        format!(
                            "`keys(...)` lists key templates, string literals such as \
                             {KEYS_EXAMPLE}"
                        ),
                    )
                })?;
            match lits.len() {
                0 => {
                    return Err(syn::Error::new(
                        parens.span.join(),
                        format!(
                            "`keys()` is empty: list the two or more key templates to take \
                             together, such as {KEYS_EXAMPLE}"
                        ),
                    ));
                }
                1 => {
                    return Err(syn::Error::new(
                        parens.span.join(),
                        "`keys(...)` takes two or more key templates, taken all or none; for \
                         one key, give the template alone: #[distributed_lock(\"account:{id}\")]",
                    ));
                }
                _ => {}
            }
            let mut templates: Vec<Template> = Vec::with_capacity(lits.len());
            let mut errors: Option<syn::Error> = None;
            for lit in &lits {
                let result = Template::parse(lit).and_then(|template| {
                    if templates.iter().any(|t| t.lit.value() == lit.value()) {
                        Err(syn::Error::new(
                            lit.span(),
                            "this key template is already in `keys(...)`: each key is taken \
                             once, give it once",
                        ))
                    } else {
                        Ok(template)
                    }
                });
                match result {
                    Ok(template) => templates.push(template),
                    Err(err) => match &mut errors {
                        Some(errors) => errors.combine(err),
                        None => errors = Some(err),
                    },
                }
            }
            return match errors {
                Some(errors) => Err(errors),
                None => Ok(Keys::Many(keyword, templates)),
            };
        }
        let lit: LitStr = input.parse().map_err(|err| {
            syn::Error::new(
                err.span(),
                format!(
                    "the first argument of #[distributed_lock] is the key template, a string \
                     literal such as \"account:{{account_id}}\", or several in {KEYS_EXAMPLE}"
                ),
            )
        })?;
        Ok(Keys::One(Template::parse(&lit)?))
    }

    /// The templates, in the order written.
    pub(crate) fn templates(&self) -> &[Template] {
        match self {
            Keys::One(template) => std::slice::from_ref(template),
            Keys::Many(_, templates) => templates,
        }
    }
}

/// The arguments of `#[distributed_lock("template", option = value, ...)]`.
pub(crate) struct Args {
    pub(crate) keys: Keys,
    pub(crate) permits: Option<(kw::permits, u32)>,
    pub(crate) timeout: Option<Timeout>,
    pub(crate) provider: Option<(kw::provider, Expr)>,
    pub(crate) guard: Option<(kw::guard, Ident)>,
    pub(crate) on_lost: Option<(kw::on_lost, OnLost)>,
    pub(crate) mode: Option<(kw::mode, Mode)>,
}

impl Parse for Args {
    fn parse(input: ParseStream<'_>) -> syn::Result<Self> {
        if input.is_empty() {
            return Err(syn::Error::new(
                Span::call_site(),
                "#[distributed_lock] needs a key template, such as \
                 #[distributed_lock(\"account:{account_id}\", timeout = 10)]",
            ));
        }
        let keys = Keys::parse(input)?;
        let mut args = Args {
            keys,
            permits: None,
            timeout: None,
            provider: None,
            guard: None,
            on_lost: None,
            mode: None,
        };
        while !input.is_empty() {
            input.parse::<Token![,]>()?;
            if input.is_empty() {
                break;
            }
            let lookahead = input.lookahead1();
            if lookahead.peek(kw::timeout) {
                let keyword: kw::timeout = input.parse()?;
                reject_duplicate(args.timeout.is_some(), keyword.span, "timeout")?;
                input.parse::<Token![=]>()?;
                args.timeout = Some(Timeout::parse(input.parse()?)?);
            } else if lookahead.peek(kw::provider) {
                let keyword: kw::provider = input.parse()?;
                reject_duplicate(args.provider.is_some(), keyword.span, "provider")?;
                input.parse::<Token![=]>()?;
                args.provider = Some((keyword, input.parse()?));
            } else if lookahead.peek(kw::guard) {
                let keyword: kw::guard = input.parse()?;
                reject_duplicate(args.guard.is_some(), keyword.span, "guard")?;
                input.parse::<Token![=]>()?;
                let name = input.call(Ident::parse_any).map_err(|err| {
                    syn::Error::new(
                        err.span(),
                        "`guard` names the variable that holds the lock's guard in the body, \
                         such as `guard = lock`",
                    )
                })?;
                args.guard = Some((keyword, name));
            } else if lookahead.peek(kw::on_lost) {
                let keyword: kw::on_lost = input.parse()?;
                reject_duplicate(args.on_lost.is_some(), keyword.span, "on_lost")?;
                input.parse::<Token![=]>()?;
                args.on_lost = Some((keyword, OnLost::parse(input)?));
            } else if lookahead.peek(kw::mode) {
                let keyword: kw::mode = input.parse()?;
                reject_duplicate(args.mode.is_some(), keyword.span, "mode")?;
                input.parse::<Token![=]>()?;
                args.mode = Some((keyword, Mode::parse(input)?));
            } else if lookahead.peek(kw::permits) {
                let keyword: kw::permits = input.parse()?;
                reject_duplicate(args.permits.is_some(), keyword.span, "permits")?;
                input.parse::<Token![=]>()?;
                args.permits = Some((keyword, parse_permits(input.parse()?)?));
            } else if input.peek(kw::keys) {
                let keyword: kw::keys = input.parse()?;
                let message = match &args.keys {
                    Keys::One(_) => format!(
                        "a key template and `keys(...)` together: give either one template \
                         (one key) or every template in `keys(...)` (several keys, taken all \
                         or none), such as #[distributed_lock({KEYS_EXAMPLE}, timeout = 10)]"
                    ),
                    Keys::Many(..) => "duplicate option `keys`: give it once".to_owned(),
                };
                return Err(syn::Error::new(keyword.span, message));
            } else if input.peek(LitStr) {
                let lit: LitStr = input.parse()?;
                return Err(syn::Error::new(
                    lit.span(),
                    format!(
                        "a second key template: to take several keys all or none, list every \
                         template in `keys(...)`, such as {KEYS_EXAMPLE}"
                    ),
                ));
            } else if input.peek(Ident::peek_any) {
                let name = input.call(Ident::parse_any)?;
                return Err(syn::Error::new(
                    name.span(),
                    format!("unknown option `{name}`; the options are {OPTIONS}"),
                ));
            } else {
                return Err(syn::Error::new(
                    input.span(),
                    format!("expected an option; the options are {OPTIONS}"),
                ));
            }
        }
        if let (Some((keyword, _)), Keys::Many(..)) = (&args.permits, &args.keys) {
            return Err(syn::Error::new(
                keyword.span,
                "`permits` and `keys(...)` together: `permits = <n>` makes one key a \
                 semaphore of n holders, `keys(...)` takes several exclusive locks; a function \
                 can do one or the other",
            ));
        }
        if let Some((keyword, Mode::Read)) = &args.mode {
            if args.permits.is_some() {
                return Err(syn::Error::new(
                    keyword.span,
                    "`mode = read` and `permits` together: a semaphore's holders are all \
                     alike, it has no readers and writers; give one or the other",
                ));
            }
            if let Keys::Many(..) = &args.keys {
                return Err(syn::Error::new(
                    keyword.span,
                    "`mode = read` and `keys(...)` together: several keys are taken as \
                     exclusive locks, all or none; take one key in read mode, or several \
                     exclusively",
                ));
            }
        }
        Ok(args)
    }
}

/// `permits = <n>`: a whole number of holders, from 1 to `u32::MAX`.
fn parse_permits(value: Expr) -> syn::Result<u32> {
    const HELP: &str = "`permits` is how many callers may hold the key at once, a whole number \
                        such as `permits = 5`";
    let bad = |message: String| Err(syn::Error::new(value.span(), message));
    match &value {
        Expr::Lit(ExprLit {
            lit: Lit::Int(int), ..
        }) if int.suffix().is_empty() => match int.base10_parse::<u64>() {
            Ok(0) => bad(format!(
                "`permits = 0` would let no caller in; {HELP} (1 is an ordinary lock)"
            )),
            Ok(n) => u32::try_from(n).or_else(|_| {
                bad(format!(
                    "`permits` is at most {} (u32::MAX); {HELP}",
                    u32::MAX
                ))
            }),
            Err(_) => bad(format!("`permits` is too large; {HELP}")),
        },
        Expr::Unary(ExprUnary {
            op: UnOp::Neg(_), ..
        }) => bad(format!("`permits` cannot be negative; {HELP}")),
        _ => bad(HELP.to_owned()),
    }
}

fn reject_duplicate(seen: bool, span: Span, name: &str) -> syn::Result<()> {
    if seen {
        Err(syn::Error::new(
            span,
            format!("duplicate option `{name}`: give it once"),
        ))
    } else {
        Ok(())
    }
}

/// `timeout = <seconds>`: a non-negative integer or decimal literal, or a string in the duration
/// grammar of URL options (`"10s"`, `"500ms"`, `"1m 30s"`).
pub(crate) struct Timeout {
    secs: u64,
    nanos: u32,
}

impl Timeout {
    fn parse(value: Expr) -> syn::Result<Self> {
        const HELP: &str = "the timeout is a number of seconds, such as `timeout = 10` or \
                            `timeout = 0.25`, or a duration as in URL options, such as \
                            `timeout = \"10s\"` or `timeout = \"500ms\"` (0 tries once)";
        let bad = |message: &str| Err(syn::Error::new(value.span(), message));
        let duration = match &value {
            Expr::Lit(ExprLit {
                lit: Lit::Int(int), ..
            }) if int.suffix().is_empty() => match int.base10_parse::<u64>() {
                Ok(secs) => std::time::Duration::from_secs(secs),
                Err(_) => return bad("the timeout is too large"),
            },
            Expr::Lit(ExprLit {
                lit: Lit::Float(float),
                ..
            }) if float.suffix().is_empty() => {
                let secs = float.base10_parse::<f64>()?;
                match std::time::Duration::try_from_secs_f64(secs) {
                    Ok(duration) => duration,
                    Err(_) => return bad("the timeout is too large"),
                }
            }
            Expr::Lit(ExprLit {
                lit: Lit::Str(text),
                ..
            }) => match dlock_template::parse_duration(&text.value()) {
                Ok(duration) => duration,
                Err(err) => {
                    return bad(&format!(
                        "the timeout {:?} is {err} (a bare number is seconds)",
                        text.value()
                    ));
                }
            },
            // `timeout = 500ms`: a literal with a unit as its suffix.
            Expr::Lit(ExprLit {
                lit: lit @ (Lit::Int(_) | Lit::Float(_)),
                ..
            }) if dlock_template::DURATION_UNITS.contains(&lit_suffix(lit)) => {
                let written = lit.to_token_stream().to_string();
                return bad(&format!(
                    "write a duration with its unit as a string: `timeout = \"{written}\"` \
                     (a bare number is seconds: `timeout = 10`)"
                ));
            }
            Expr::Unary(ExprUnary {
                op: UnOp::Neg(_), ..
            }) => return bad(&format!("the timeout cannot be negative; {HELP}")),
            _ => return bad(HELP),
        };
        Ok(Timeout {
            secs: duration.as_secs(),
            nanos: duration.subsec_nanos(),
        })
    }

    /// The timeout as a `Duration` expression.
    pub(crate) fn tokens(timeout: Option<&Timeout>) -> TokenStream {
        let (secs, nanos) = timeout.map_or((0, 0), |t| (t.secs, t.nanos));
        quote!(::core::time::Duration::new(#secs, #nanos))
    }
}

/// The suffix of a number literal (`ms` of `500ms`), empty if it has none.
fn lit_suffix(lit: &Lit) -> &str {
    match lit {
        Lit::Int(int) => int.suffix(),
        Lit::Float(float) => float.suffix(),
        _ => "",
    }
}

/// The key template, parsed by the grammar the library's runtime templates share.
pub(crate) struct Template {
    /// The literal, whose span every template error points at.
    pub(crate) lit: LitStr,
    pub(crate) parsed: dlock_template::Template,
}

impl Template {
    fn parse(lit: &LitStr) -> syn::Result<Self> {
        let text = lit.value();
        if text.is_empty() {
            return Err(syn::Error::new(
                lit.span(),
                "the key template is empty; a lock key needs text, such as \"account:{account_id}\"",
            ));
        }
        let parsed = dlock_template::Template::parse(&text)
            .map_err(|err| syn::Error::new(lit.span(), err))?;
        Ok(Template {
            lit: lit.clone(),
            parsed,
        })
    }
}

#[cfg(test)]
mod tests {
    use dlock_template::Segment;

    use super::*;

    fn parse(template: &str) -> Result<Vec<String>, String> {
        let lit = LitStr::new(template, Span::call_site());
        Template::parse(&lit)
            .map(|t| {
                t.parsed
                    .segments()
                    .iter()
                    .map(|segment| match segment {
                        Segment::Literal(text) => format!("lit {text}"),
                        Segment::Placeholder(p) => format!("var {}", p.name()),
                    })
                    .collect()
            })
            .map_err(|err| err.to_string())
    }

    // The grammar's own cases are tested in `dlock_template`; these hold the messages the
    // attribute reports.
    #[test]
    fn templates_and_their_errors() {
        assert_eq!(
            parse("t:{cmd.owner.0}:<self.name>:{r#type}").unwrap(),
            [
                "lit t:",
                "var cmd.owner.0",
                "lit :",
                "var self.name",
                "lit :",
                "var type"
            ]
        );
        let cases = [
            ("", "the key template is empty"),
            ("a:{b", "unclosed `{`"),
            ("a:<b", "unclosed `<`"),
            ("a:{b>", "unclosed `{`"),
            ("a}", "unmatched `}`"),
            ("a>", "unmatched `>`"),
            ("a:{}", "empty placeholder `{}`"),
            ("a:{b c}", "invalid placeholder `{b c}`"),
            ("a:{b.}", "invalid placeholder"),
            ("a:{1x}", "invalid placeholder"),
            ("a:{_}", "invalid placeholder"),
            ("{a}{b}", "need a `:`"),
            ("{a}-{b}", "with only `-`"),
        ];
        for (template, message) in cases {
            let err = parse(template).unwrap_err();
            assert!(err.contains(message), "{template:?}: {err}");
        }
    }

    #[test]
    fn on_lost_values() {
        let on_lost = |tokens: &str| {
            let args: Args = syn::parse_str(&format!("\"k\", on_lost = {tokens}"))
                .map_err(|err| err.to_string())?;
            Ok::<_, String>(args.on_lost.map(|(_, v)| v))
        };
        assert_eq!(on_lost("cancel"), Ok(Some(OnLost::Cancel)));
        assert_eq!(on_lost("finish"), Ok(Some(OnLost::Finish)));
        assert!(
            on_lost("stop")
                .unwrap_err()
                .contains("unknown `on_lost` value `stop`")
        );
        assert!(
            on_lost("\"cancel\"")
                .unwrap_err()
                .contains("`on_lost` is `cancel`")
        );
        let args: Args = syn::parse_str("\"k\", guard = g").unwrap();
        assert!(args.on_lost.is_none());
    }

    #[test]
    fn timeouts() {
        let secs = |tokens: &str| {
            let args: Args = syn::parse_str(&format!("\"k\", timeout = {tokens}"))
                .map_err(|err| err.to_string())?;
            let t = args.timeout.unwrap();
            Ok::<_, String>((t.secs, t.nanos))
        };
        assert_eq!(secs("10"), Ok((10, 0)));
        assert_eq!(secs("0"), Ok((0, 0)));
        assert_eq!(secs("0.25"), Ok((0, 250_000_000)));
        assert_eq!(secs("1_000"), Ok((1000, 0)));
        assert!(secs("-1").unwrap_err().contains("cannot be negative"));
        assert!(secs("10ms").unwrap_err().contains("`timeout = \"10ms\"`"));
        assert!(secs("1.5s").unwrap_err().contains("`timeout = \"1.5s\"`"));
        assert!(secs("10u64").unwrap_err().contains("number of seconds"));
        assert_eq!(secs("\"10s\""), Ok((10, 0)));
        assert_eq!(secs("\"500ms\""), Ok((0, 500_000_000)));
        assert_eq!(secs("\"1m 30s\""), Ok((90, 0)));
        assert_eq!(secs("\" 2.5 \""), Ok((2, 500_000_000)));
        assert_eq!(secs("\"0\""), Ok((0, 0)));
        assert!(secs("\"2d\"").unwrap_err().contains("is not a duration"));
        assert!(
            secs("\"soon\"")
                .unwrap_err()
                .contains("write it like `30s`")
        );
        assert!(secs("1e300").unwrap_err().contains("too large"));
        assert!(secs("x").unwrap_err().contains("number of seconds"));
    }
}
