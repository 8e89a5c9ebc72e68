//! Throwaway certificate authorities and server certificates for the TLS tests, made in process
//! with rcgen (ECDSA P-256, ring) and written as PEM files to a temp dir.
//!
//! | file | what |
//! |---|---|
//! | [`Pki::ca`] | the CA the clients are told to trust |
//! | [`Pki::other_ca`] | another CA, which signed nothing the servers present (the "wrong CA") |
//! | [`ServerCert::Good`] | for `127.0.0.1` only (an IP address SAN), valid now, signed by the CA |
//! | [`ServerCert::Expired`] | the same name and CA, valid from 2020-01-01 to 2021-01-01 |
//!
//! A client that connects by `localhost` (which resolves to 127.0.0.1 here) reaches the same
//! server but asks for a name the good certificate does not carry: the "wrong host name".

use std::path::{Path, PathBuf};

pub use crate::ServerTls;

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};

/// Which server certificate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ServerCert {
    /// For `127.0.0.1`, valid now.
    Good,
    /// For `127.0.0.1`, expired on 2021-01-01.
    Expired,
}

/// A test CA, another CA, and the server certificates, as files.
#[derive(Debug)]
pub struct Pki {
    dir: PathBuf,
    /// The CA that signed the server certificates (PEM).
    pub ca: PathBuf,
    /// A CA that signed nothing the servers present (PEM).
    pub other_ca: PathBuf,
}

fn ca(name: &str) -> (CertificateParams, KeyPair, String) {
    let mut params = CertificateParams::new(Vec::<String>::new()).expect("CA params");
    params.distinguished_name.push(DnType::CommonName, name);
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    let key = KeyPair::generate().expect("CA key");
    let pem = params.self_signed(&key).expect("self-signed CA").pem();
    (params, key, pem)
}

impl Default for Pki {
    fn default() -> Pki {
        Pki::new()
    }
}

impl Pki {
    /// Makes both CAs and both server certificates in a new temp dir (kept until the test
    /// binary's temp files are cleaned; the files are small).
    pub fn new() -> Pki {
        let dir = tempfile::Builder::new()
            .prefix("dlock-pki-")
            .tempdir()
            .expect("temp dir")
            .keep();
        let (ca_params, ca_key, ca_pem) = ca("dlock test CA");
        let (_, _, other_pem) = ca("dlock other CA");
        let issuer = Issuer::new(ca_params, ca_key);
        let write = |name: &str, text: &str| {
            let path = dir.join(name);
            std::fs::write(&path, text).expect("write a PEM file");
            path
        };
        let ca = write("ca.pem", &ca_pem);
        let other_ca = write("other-ca.pem", &other_pem);
        for (which, name) in [(ServerCert::Good, "good"), (ServerCert::Expired, "expired")] {
            let mut params =
                CertificateParams::new(vec!["127.0.0.1".to_owned()]).expect("server params");
            params
                .distinguished_name
                .push(DnType::CommonName, "dlock test server");
            // Client authentication too: Redis nodes present it on the cluster bus, where
            // the accepting node always asks for a client certificate.
            params.extended_key_usages = vec![
                ExtendedKeyUsagePurpose::ServerAuth,
                ExtendedKeyUsagePurpose::ClientAuth,
            ];
            params.key_usages = vec![
                KeyUsagePurpose::DigitalSignature,
                KeyUsagePurpose::KeyEncipherment,
            ];
            if which == ServerCert::Expired {
                params.not_before = rcgen::date_time_ymd(2020, 1, 1);
                params.not_after = rcgen::date_time_ymd(2021, 1, 1);
            }
            let key = KeyPair::generate().expect("server key");
            let cert = params.signed_by(&key, &issuer).expect("sign");
            write(&format!("{name}.pem"), &cert.pem());
            write(&format!("{name}.key"), &key.serialize_pem());
        }
        Pki { dir, ca, other_ca }
    }

    /// The files of one server certificate.
    pub fn server(&self, which: ServerCert) -> ServerTls {
        let name = match which {
            ServerCert::Good => "good",
            ServerCert::Expired => "expired",
        };
        ServerTls {
            cert: self.dir.join(format!("{name}.pem")),
            key: self.dir.join(format!("{name}.key")),
            ca: self.ca.clone(),
        }
    }

    /// The temp dir that holds every file.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// One set of certificates for the whole test binary.
    pub fn shared() -> &'static Pki {
        static PKI: std::sync::OnceLock<Pki> = std::sync::OnceLock::new();
        PKI.get_or_init(Pki::new)
    }
}
